"""``ssd train-draft``: distil a draft for a target (by default SmolLM2-135M-Instruct), offline and resumably.

Stages (``--stage``; ``all`` runs those not done yet, each resumable from what it wrote in ``OUT``):
  1. ``data-stdlib`` / ``data-gen``: teacher data (:mod:`spec_core.training.draft_data`);
  2. ``vocab``: the draft vocabulary, the ``draft_vocab`` most frequent next tokens of the teacher data (plus the
     special tokens), written as ``OUT/token_map.npy``;
  3. ``train``: the student (:mod:`spec_core.training.student`), soft cross-entropy on the teacher's top-k
     restricted to the map, checkpointed to ``OUT/ckpt/student.pt`` every ``ckpt_every`` steps;
  4. ``export``: an HF folder (``OUT/draft``) with the map and its model card, and ``OUT/report.json``
     (held-out agreement);
  5. ``eval`` (not part of ``all``; run by the CLI): greedy SD tokens per round and the draft's cost
     (:mod:`benchmarks.draft_quality`), added to the report and the card.

Budgets are in tokens and optimizer steps, and every random choice is seeded, so a run is reproducible.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from spec_core.model_paths import resolve_model
from spec_core.training.draft_data import ONE_PROCESS, DataConfig, Shard

logger = logging.getLogger(__name__)

STAGES = ("data-stdlib", "data-gen", "vocab", "train", "export", "all", "eval")
#: the fine-tune recipes' prompt counts (before ``--data-scale``): code continuations, templated chat,
#: questions the target writes itself, everyday requests (prose)
RECIPES = {
    "mixed": dict(num_code_prompts=1100, num_chat_prompts=1000, num_selfinstruct=1400, num_prose_prompts=0),
    "chat": dict(num_code_prompts=900, num_chat_prompts=800, num_selfinstruct=1600, num_prose_prompts=2400),
}


@dataclass(frozen=True, slots=True)
class StudentShape:
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int = 1800
    batch_tokens: int = 3840
    seq_len: int = 384
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.01
    ckpt_every: int = 100
    #: bf16 autocast for the student's matmuls where the CPU has native bf16 (1.5x faster here); fp32 master weights
    bf16_autocast: bool = True
    heldout_fraction: float = 0.02  # of the gen documents, never trained on
    heldout_stdlib_tokens: int = 12_000  # of the held-out stdlib files, labelled at export (0: none)


@dataclass(frozen=True, slots=True)
class DraftTrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    shape: StudentShape = field(default_factory=StudentShape)
    train: TrainConfig = field(default_factory=TrainConfig)
    draft_vocab: int = 12288
    seed: int = 0
    #: an exported draft folder to start from (its weights and token map); ``None`` trains from scratch
    init_from: str | None = None

    @staticmethod
    def finetune(init_from: str, seed: int | None = None, gen_dtype: str | None = None,
                 scale: float | None = None, recipe: str = "mixed") -> DraftTrainConfig:
        """Continue an exported draft on fresh self-generated data only (no stdlib pass), at a lower rate.

        The data is the target's greedy (and some sampled) answers to templated and self-written questions,
        and its code continuations run past EOS as the HumanEval measure does. Shape and vocabulary come
        from ``init_from``. ``seed`` draws other prompts, ``scale`` multiplies their counts and ``gen_dtype``
        sets the teacher's dtype. ``recipe`` picks the mix (:data:`RECIPES`): ``chat`` leans on everyday prose,
        where the draft is weakest; ``mixed`` with the other defaults reproduces the third stage's recipe.
        """
        c = json.loads((Path(init_from) / "config.json").read_text())
        shape = StudentShape(hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
                             num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                             intermediate_size=c["intermediate_size"])
        vocab = len(json.loads((Path(init_from) / "token_map.json").read_text()))
        seed = 1 if seed is None else seed
        n = lambda count: max(1, round(count * (scale or 1.0)))  # noqa: E731
        counts = {k: n(v) if v else 0 for k, v in RECIPES[recipe].items()}
        data = replace(DataConfig(), stdlib_tokens=0, **counts, sampled_fraction=0.25, code_ignore_eos=True,
                       gen_batch=48, seed=seed, gen_dtype=gen_dtype or DataConfig.gen_dtype)
        train = replace(TrainConfig(), steps=500, lr=6e-4, min_lr=3e-5, warmup=20, ckpt_every=25)
        return DraftTrainConfig(data=data, shape=shape, train=train, draft_vocab=vocab, seed=seed,
                                init_from=str(resolve_model(init_from).resolve()))  # a shipped, packed draft unpacked

    @staticmethod
    def smoke() -> DraftTrainConfig:
        return DraftTrainConfig(
            data=replace(DataConfig(), stdlib_tokens=2048, corpus_files=40, chunk_len=128, chunks_per_shard=8, num_code_prompts=4,
                         num_chat_prompts=4, code_max_new=8, chat_max_new=8, gen_batch=4),
            shape=StudentShape(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128),
            train=replace(TrainConfig(), steps=3, batch_tokens=256, seq_len=64, ckpt_every=2, warmup=1, heldout_stdlib_tokens=0,
                          bf16_autocast=False),
            draft_vocab=2048,
        )


def _teacher(target_path: str, dtype: str):
    from spec_core.config import parse_dtype
    from spec_core.models import load_tokenizer
    from spec_core.runner import ModelRunner

    return ModelRunner(target_path, dtype=parse_dtype(dtype)), load_tokenizer(target_path)


def run_data(out: Path, target_path: str, cfg: DraftTrainConfig, source: str, progress,
             shard: Shard = ONE_PROCESS) -> None:
    from spec_core.models import eos_token_ids
    from spec_core.training.corpus import load_corpus
    from spec_core.training.draft_data import make_gen_data, make_stdlib_data

    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    if source == "stdlib" and cfg.data.stdlib_tokens <= 0:  # the fine-tune recipe: no teacher to load
        return
    runner, tokenizer = _teacher(target_path, cfg.data.dtype if source == "stdlib" else cfg.data.gen_dtype)
    corpus = load_corpus(max_files=cfg.data.corpus_files)
    if source == "stdlib":
        make_stdlib_data(runner, tokenizer, corpus, cfg.data, data_dir, progress)
    else:
        make_gen_data(runner, tokenizer, corpus, eos_token_ids(runner, tokenizer), cfg.data, data_dir, progress,
                      shard)


def save_config(out: Path, cfg: DraftTrainConfig, target_path: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train_config.json"
    record = {"target": target_path, **asdict(cfg)}
    if path.exists():
        old = json.loads(path.read_text())
        if {k: v for k, v in old.items() if k != "train"} != {k: v for k, v in record.items() if k != "train"}:
            raise ValueError(f"{out} was started with another configuration ({path}); use a new --out")
    path.write_text(json.dumps(record, indent=1) + "\n")


def train_draft(out: Path, target_path: str, cfg: DraftTrainConfig, stage: str = "all", progress=None,
                shard: Shard = ONE_PROCESS) -> dict:
    """Run ``stage`` (or every stage not yet done) and return the report (empty until ``export``).

    ``shard`` splits ``data-gen`` between processes that share ``out`` (one per core).
    """
    from tqdm import tqdm

    progress = progress or tqdm
    save_config(out, cfg, target_path)
    torch.manual_seed(cfg.seed)
    if stage in ("data-stdlib", "all"):
        run_data(out, target_path, cfg, "stdlib", progress)
    if stage in ("data-gen", "all"):
        run_data(out, target_path, cfg, "gen", progress, shard)
    if stage in ("vocab", "train", "export", "all"):
        from spec_core.training.student import build_token_map, export_draft, train_student

        if stage in ("vocab", "all") or not (out / "token_map.npy").exists():
            build_token_map(out, cfg)
        if stage in ("train", "all"):
            train_student(out, target_path, cfg, progress)
        if stage in ("export", "all"):
            return export_draft(out, target_path, cfg)
    return {}


def report_path(out: Path) -> Path:
    return out / "report.json"


def load_report(out: Path) -> dict:
    p = report_path(out)
    return json.loads(p.read_text()) if p.exists() else {}



