"""The continuous-batching verifier engine: batching equality, tree masks, KV accounting, per-request params."""

from __future__ import annotations

import pytest
import torch
from reference_decoding import generate_ar

from spec_core.config import SamplingParams
from spec_core.draft_engine import BatchDrafter, DraftConfig
from spec_core.models import load_tokenizer
from spec_core.packing import WorkItem, pack
from spec_core.prompts import humaneval_prompts
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from spec_core.tree import TokenTree
from verifier_service.engine import EngineConfig, VerifierEngine
from verifier_service.scheduler import SchedulerConfig


def make_engine(target: ModelRunner, draft: ModelRunner | None, k: int = 4, branching: int = 1,
                num_blocks: int = 256, max_num_seqs: int = 16, budget: int = 2048) -> VerifierEngine:
    drafter = BatchDrafter(draft, DraftConfig(k=k, branching=branching, num_blocks=num_blocks, block_size=8)) \
        if draft is not None else None
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_spec_nodes=k * branching)
    return VerifierEngine(target, EngineConfig(num_blocks=num_blocks, block_size=8, scheduler=sched),
                          drafter=drafter, k=k)


def ar_reference(target: ModelRunner, prompt: list[int], n: int) -> list[int]:
    seq = Sequence("ref", prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    generate_ar(target, seq)
    return seq.output_ids


def run_staggered(engine: VerifierEngine, seqs: list[Sequence], every: int = 2) -> None:
    """Add one request every ``every`` steps (arrivals at different steps), then drain."""
    pending = list(seqs)
    step = 0
    while pending or engine.has_work():
        if pending and step % every == 0:
            engine.add(pending.pop(0))
        engine.step()
        step += 1


def assert_all_free(engine: VerifierEngine) -> None:
    engine.blocks.check_all_free()
    if engine.drafter is not None:
        engine.drafter.blocks.check_all_free()


CONFIGS = [("chain", 4, 1), ("tree", 3, 3), ("ar", 0, 1)]


@pytest.mark.parametrize("name,k,branching", CONFIGS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batching_equality_tiny(tiny_models, family, name, k, branching):
    target = ModelRunner(tiny_models[family])
    draft = ModelRunner(tiny_models[f"{family}-draft"]) if k else None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (2 + 5 * i,), generator=gen).tolist() for i in range(9)]
    lengths = [16 + 3 * i for i in range(9)]
    seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    engine = make_engine(target, draft, k=k, branching=branching)
    run_staggered(engine, seqs)
    for seq, p, n in zip(seqs, prompts, lengths):
        assert seq.output_ids == ar_reference(target, p, n), f"request {seq.request_id} ({name})"
    assert_all_free(engine)
    assert max(engine.metrics.batch_sizes) >= 8


@pytest.mark.parametrize("k,branching", [(5, 1), (3, 2)])
def test_batching_equality_toy_pair(toy_pair, k, branching):
    target, draft = ModelRunner(toy_pair["target"]), ModelRunner(toy_pair["draft"])
    tok = load_tokenizer(toy_pair["target"])
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in humaneval_prompts(10)]
    seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=24 + 4 * (i % 3), ignore_eos=True))
            for i, p in enumerate(prompts)]
    engine = make_engine(target, draft, k=k, branching=branching, num_blocks=1024)
    run_staggered(engine, seqs, every=1)
    for seq, p in zip(seqs, prompts):
        assert seq.output_ids == ar_reference(target, p, seq.params.max_new_tokens)
    assert_all_free(engine)


def test_tree_mask_matches_each_path_alone(tiny_models):
    """Every node's logits in one tree forward equal those of running its path alone (fp32, 1e-4)."""
    runner = ModelRunner(tiny_models["llama"])
    prompt = torch.randint(0, 256, (11,)).tolist()
    tree = TokenTree(parents=[-1, -1, 0, 0, 1, 2, 4], token_ids=torch.randint(0, 256, (7,)).tolist())
    cache = runner.new_paged_cache(16, 8)
    slots = list(range(len(prompt) + tree.num_nodes))  # identity block table for one request
    n = len(prompt)
    depths = tree.depths()
    item = WorkItem(prefix_slots=[], token_ids=prompt + tree.token_ids,
                    positions=list(range(n)) + [n - 1 + d for d in depths], write_slots=slots, num_pending=n,
                    parents=tree.parents, logits_rows=list(range(n - 1, n + tree.num_nodes)))
    got = runner.forward_paged(cache, pack([item], cache.scratch_slot))[0]
    for i in range(-1, tree.num_nodes):
        path = prompt + [tree.token_ids[j] for j in (tree.path_to(i) if i >= 0 else [])]
        alone = runner.forward(runner.new_cache(1, 64), torch.tensor([path]), torch.arange(len(path))[None])
        assert (got[i + 1] - alone[0, -1]).abs().max().item() < 1e-4, f"node {i}"


def test_tiny_kv_budget_preempts_and_stays_exact(tiny_models):
    target, draft = ModelRunner(tiny_models["llama"]), ModelRunner(tiny_models["llama-draft"])
    prompts = [torch.randint(0, 256, (6 + 3 * i,)).tolist() for i in range(6)]
    seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)]
    engine = make_engine(target, draft, k=4, num_blocks=24)  # 24 blocks of 8 slots: far less than 6 requests need
    for s in seqs:
        engine.add(s)
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    for seq, p in zip(seqs, prompts):
        assert seq.output_ids == ar_reference(target, p, 40)
    assert_all_free(engine)


def test_cancel_frees_blocks(tiny_models):
    target, draft = ModelRunner(tiny_models["llama"]), ModelRunner(tiny_models["llama-draft"])
    engine = make_engine(target, draft)
    seqs = [Sequence(str(i), [1, 2, 3, 4 + i], SamplingParams(max_new_tokens=50, ignore_eos=True)) for i in range(4)]
    for s in seqs:
        engine.add(s)
    for _ in range(3):
        engine.step()
    engine.cancel(seqs[0])
    engine.cancel(seqs[3])
    engine.run()
    assert seqs[0].finish_reason == "cancelled" and seqs[1].finish_reason == "length"
    assert_all_free(engine)


def test_mixed_sampling_params_in_one_batch(tiny_models):
    """Greedy rows stay exact next to sampled rows; seeded sampled rows are reproducible."""
    target, draft = ModelRunner(tiny_models["llama"]), ModelRunner(tiny_models["llama-draft"])
    prompt = [5, 6, 7, 8]

    def batch():
        seqs = [Sequence("g", prompt, SamplingParams(max_new_tokens=30, ignore_eos=True)),
                Sequence("s1", prompt, SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=30)),
                Sequence("s2", prompt, SamplingParams(temperature=1.2, top_k=5, seed=2, max_new_tokens=30)),
                Sequence("stop", prompt, SamplingParams(max_new_tokens=30, stop_token_ids=(0,)))]
        engine = make_engine(target, draft, k=3)
        for s in seqs:
            engine.add(s)
        engine.run()
        assert_all_free(engine)
        return seqs

    a, b = batch(), batch()
    assert a[0].output_ids == ar_reference(target, prompt, 30)
    assert a[1].output_ids == b[1].output_ids and a[2].output_ids == b[2].output_ids
    assert a[1].output_ids != a[0].output_ids


# ---- host↔device crossings ------------------------------------------------------------------------------------
HOT_PATH_MODULES = ("verifier_service/engine.py", "verifier_service/ssd_proposer.py", "spec_core/draft_engine.py",
                    "drafter_service/ssd_drafter.py", "spec_core/sampling.py", "spec_core/tree.py",
                    "spec_core/packing.py", "spec_core/runner.py", "spec_core/ngram.py", "spec_core/kv_cache.py",
                    "spec_core/tree_draft.py", "spec_core/chain_verify.py", "spec_core/tree_batch.py",
                    "verifier_service/target_rows.py")
FORBIDDEN = (".item()", ".tolist()", ".cpu()", "torch.tensor(")


def _crossing_calls(text: str) -> list[str]:
    return [f"line {i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
            if any(f in line for f in FORBIDDEN)]


def test_hot_paths_cross_only_through_the_counted_helpers():
    """``.item()``, ``.tolist()``, ``.cpu()`` and ``torch.tensor(`` appear only in spec_core/transfer.py."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bad = {m: hits for m in HOT_PATH_MODULES if (hits := _crossing_calls((root / m).read_text(encoding="utf-8")))}
    assert not bad, bad
    assert _crossing_calls("x = logits.argmax(-1).tolist()\n")  # negative control: the scan sees one


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_greedy_verify_step_at_batch_16_crosses_at_most_twice(tiny_models, mode):
    """One upload (the packed batch) and one download (every row's argmax) per verifier step, whatever the
    batch size; the proposer's own crossings (SD's draft engine) are counted apart."""
    from spec_core.transfer import crossings

    target = ModelRunner(tiny_models["llama"])
    draft = ModelRunner(tiny_models["llama-draft"]) if mode == "sd" else None
    engine = make_engine(target, draft, k=3, num_blocks=512)
    prompts = [[(7 * i + j) % 50 + 3 for j in range(6)] for i in range(16)]
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    verify_steps = []
    while engine.has_work():
        before = crossings().total
        batch = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        engine.step()
        m = engine.metrics
        if batch == 16 and all(s.output_ids for s in seqs):  # every request past prefill: a pure verify step
            verify_steps.append(m.last_step_crossings)
        assert crossings().total - before >= m.last_step_crossings
    assert verify_steps, "no step verified all 16 requests"
    assert max(verify_steps) <= 2, verify_steps
    for s in seqs:
        assert s.output_ids == ar_reference(target, s.prompt_ids, 8)


@pytest.mark.parametrize("batch", [4, 16])
def test_sampled_verify_step_crosses_five_times_at_any_batch(tiny_models, batch):
    """A sampled SD step verifies every request's chain together on the device (the tokens are the per-request
    rule's: tests/test_chain_verify.py): one download for the batch (each round's tests passed and last token),
    no argmax download, and the same crossings at any batch size."""
    target, draft = ModelRunner(tiny_models["llama"]), ModelRunner(tiny_models["llama-draft"])
    engine = make_engine(target, draft, k=3, num_blocks=512)
    seqs = [Sequence(f"r{i}", [(7 * i + j) % 50 + 3 for j in range(6)],
                     SamplingParams(temperature=0.8, max_new_tokens=8, ignore_eos=True)) for i in range(batch)]
    for s in seqs:
        engine.add(s)
    steps = []
    while engine.has_work():
        full = all(s.output_ids and s.remaining > 3 for s in seqs)  # every request verifies a K = 3 chain
        engine.step()
        if full:
            steps.append(engine.metrics.last_step_crossings)
    # the packed batch, the rows' indices, their settings and the chains' tokens and uniforms up; the results down
    assert steps and all(total == 5 for total in steps), steps
    assert all(len(s.output_ids) == 8 for s in seqs)


def test_host_copy_brings_every_result_down_in_one_download():
    from spec_core.transfer import HostCopy, crossings

    down = HostCopy()
    a, b, c = (down.add(torch.arange(6).view(2, 3)), down.add(torch.tensor([7, 8], dtype=torch.int32)),
               down.add(torch.zeros(0, 4, dtype=torch.long)))
    before = crossings().downloads
    down.fetch()
    assert crossings().downloads == before + 1
    assert (down[a], down[b], down[c]) == ([[0, 1, 2], [3, 4, 5]], [7, 8], [])
    with pytest.raises(RuntimeError):
        down.add(torch.ones(1))
    empty = HostCopy()
    empty.fetch()
    assert crossings().downloads == before + 1  # nothing queued: nothing crosses


@pytest.mark.parametrize("branching", [1, 2])
def test_a_mixed_step_downloads_once_and_keeps_every_requests_tokens(tiny_models, branching):
    """Greedy and seeded sampled requests in one SD batch, plain rounds among them at the end: each verifier step
    downloads once (the argmaxes, the draws and the chains' or sibling trees' outcomes together), greedy output is
    the target's own, and each sampled request's tokens are those it gets alone."""
    from spec_core.transfer import crossings

    target, draft = ModelRunner(tiny_models["llama"]), ModelRunner(tiny_models["llama-draft"])
    params = [SamplingParams(max_new_tokens=9, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, seed=10 + i, max_new_tokens=9, ignore_eos=True, coupled=False)
              for i in range(6)]
    prompts = [[(7 * i + j) % 50 + 3 for j in range(6)] for i in range(6)]

    def run(indices):
        engine = make_engine(target, draft, k=3, branching=branching, num_blocks=512)
        seqs = [Sequence(f"r{i}", prompts[i], params[i]) for i in indices]
        for s in seqs:
            engine.add(s)
        downloads = []
        while engine.has_work():
            engine.step()
            downloads.append(engine.metrics.last_step_downloads)
        return [s.output_ids for s in seqs], downloads

    together, downloads = run(range(6))
    assert max(downloads) == 1, downloads
    assert crossings().downloads > 0
    for i in range(6):
        alone = run([i])[0][0]
        assert together[i] == alone, i
        if i % 2:
            assert alone == ar_reference(target, prompts[i], 9)


def test_sampled_rows_equal_the_per_request_computation():
    """One softmax over every sampled request's rows, and one draw for the plain rounds among them, give the
    per-request values bit for bit (so a seeded request's tokens do not depend on its batch)."""
    from spec_core.sampling import request_probs
    from spec_core.sequence import VERIFY
    from spec_core.transfer import HostCopy, crossings
    from spec_core.tree import stochastic_verify_tree_path
    from verifier_service.target_rows import sampled_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, 50, generator=gen) * 4
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.3, top_p=0.9, seed=2),
              SamplingParams(temperature=0.5, top_k=7, seed=3), SamplingParams(temperature=0.8, seed=4),
              SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.9, top_k=9, seed=6)]
    seqs = [Sequence(f"r{i}", [1, 2, 3 + i], p) for i, p in enumerate(params)]
    q = torch.softmax(torch.randn(3, 50, generator=gen), -1)
    trees = [TokenTree([], [], None), TokenTree([-1, 0], [4, 9], q[:2]), TokenTree([], [], None),
             TokenTree([-1], [4], q[:1]), TokenTree([-1, -1, 0], [4, 4, 7], q), TokenTree([-1, -1], [3, 5], q[:2])]
    down = HostCopy()
    out = sampled_rows(logits, [(b, s, t) for b, (s, t) in enumerate(zip(seqs, trees))], down)
    before = crossings().downloads
    down.fetch()
    out.resolve(down)
    assert crossings().downloads == before + 1  # the draws and the trees' outcomes in one download
    assert set(out.picks) == {"r0", "r2"} and set(out.verified) == {"r1", "r3", "r4", "r5"}
    for b, (s, t) in enumerate(zip(seqs, trees)):
        alone = request_probs(logits[b, : t.num_nodes + 1][None], [s.params])[0]
        assert torch.equal(out.probs[s.request_id], alone)
        u = s.uniforms_at(s.num_tokens, t.num_nodes + 1, VERIFY)
        if not t.num_nodes:
            assert [out.picks[s.request_id]] == stochastic_verify_tree_path(alone, t, u)[0]
        else:
            assert out.verified[s.request_id] == stochastic_verify_tree_path(alone, t, u)
    control = sampled_rows(logits.flip(0), [(b, s, t) for b, (s, t) in enumerate(zip(seqs, trees))], HostCopy())
    assert not torch.equal(control.probs["r0"], out.probs["r0"])  # the rows really are each request's own
