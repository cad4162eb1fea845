"""Offline prompts for draft distillation, built from what every machine has: the stdlib source and its docs.

Two kinds, both deterministic for a seed:
- **code**: the head of a stdlib function (signature and docstring), which the target continues as code;
- **chat**: instructions built from stdlib docstrings, the language reference topics (``pydoc_data``) and a
  fixed list of general topics, sent through the target's chat template.

No benchmark prompt is used (HumanEval, MT-Bench and the like are never read). Held-out stdlib files
(:data:`~spec_core.training.corpus.HELDOUT_FILES`) are excluded here too.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass

from spec_core.training.corpus import Corpus

GENERAL_TOPICS = (
    "the water cycle", "photosynthesis", "the history of the printing press", "how vaccines work", "black holes",
    "the French Revolution", "climate and weather", "the human heart", "volcanoes", "the Roman Empire",
    "electric cars", "the internet", "healthy sleep", "learning a new language", "saving money", "public speaking",
    "time management", "the solar system", "honey bees", "the Great Wall of China", "machine learning",
    "recycling", "the ocean tides", "coffee", "chess", "the Olympic Games", "earthquakes", "bread baking",
    "gardening", "the moon landing", "renewable energy", "friendship", "writing a good essay", "the piano",
    "rainforests", "the stock market", "first aid", "dinosaurs", "the immune system", "mountains",
    "job interviews", "cooking pasta", "the theory of evolution", "bicycles", "cloud computing", "deserts",
    "democracy", "the periodic table", "meditation", "airplanes", "music theory", "ancient Egypt",
    "exercise", "databases", "the speed of light", "tea", "rivers", "teamwork", "cats", "libraries",
)
GENERAL_TEMPLATES = (
    "Write a short paragraph about {t}.", "Explain {t} to a ten-year-old.", "Give me three facts about {t}.",
    "What are the main ideas behind {t}?", "Write a short poem about {t}.", "List some pros and cons of {t}.",
    "Why is {t} important?", "Tell me a short story that involves {t}.", "Summarize what you know about {t}.",
    "What questions would a student ask about {t}? Answer two of them.",
)
CODE_TEMPLATES = (
    "Write a Python function `{name}{sig}` that {summary}",
    "How do I {summary_l} in Python?",
    "Explain what the function `{module}.{name}` does.",
    "Write an example that uses `{module}.{name}`.",
    "Write a docstring and a short test for a function that does this: {summary_l}.",
)
SNIPPET_TEMPLATES = (
    "What does this code do?\n```python\n{code}\n```",
    "Review this Python code and suggest one improvement:\n```python\n{code}\n```",
    "Add comments to this code:\n```python\n{code}\n```",
)
#: how a self-instruct question opens (the target writes the rest of the user turn)
QUESTION_STARTERS = (
    "How", "What", "Why", "Write", "Explain", "Can you", "Give me", "I", "Describe", "List", "Create", "Help me",
    "Tell me", "Which", "Is it", "Should I", "Compare", "Summarize", "Suggest", "Plan", "My", "In Python,",
    "Translate", "Rewrite", "When", "Who", "Where", "Do you", "Please", "Imagine",
)
TOPIC_TEMPLATES = (
    "Summarize this part of the Python reference:\n\n{text}",
    "Explain the following in simple words:\n\n{text}",
)


@dataclass(frozen=True, slots=True)
class FunctionInfo:
    module: str
    name: str
    signature: str
    summary: str
    head: str  # source of the def line(s) and the docstring
    source: str


def _functions(rel: str, text: str, max_source_lines: int = 30) -> list[FunctionInfo]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or not node.body or node.end_lineno is None:
            continue
        first = node.body[0]
        if not isinstance(first, ast.Expr) or first.end_lineno is None:
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if not 12 <= len(summary) <= 200:
            continue
        start = node.lineno - 1 - len(node.decorator_list)
        head = "\n".join(lines[start:first.end_lineno]) + "\n"
        body = lines[start:node.end_lineno]
        if len(body) > max_source_lines:
            continue
        sig = "(" + ", ".join(a.arg for a in node.args.args) + ")"
        out.append(FunctionInfo(module, node.name, sig, summary, head, "\n".join(body)))
    return out


def _dedent(code: str) -> str:
    import textwrap

    return textwrap.dedent(code)


def build_prompts(corpus: Corpus, num_code: int, num_chat: int, seed: int) -> tuple[list[str], list[list[dict]]]:
    """``num_code`` raw code prompts and ``num_chat`` chat conversations (one user turn each)."""
    rng = random.Random(seed)
    funcs = [f for rel, text in corpus.train for f in _functions(rel, text)]
    rng.shuffle(funcs)
    code = [_dedent(f.head) for f in funcs[:num_code]]
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for v in topics.values() for p in v.split("\n\n") if 200 <= len(p.strip()) <= 900]
    chat: list[str] = []
    while len(chat) < num_chat:
        kind = rng.random()
        if kind < 0.35:
            t = rng.choice(GENERAL_TOPICS)
            chat.append(rng.choice(GENERAL_TEMPLATES).format(t=t))
        elif kind < 0.7:
            f = rng.choice(funcs)
            s = f.summary.rstrip(".")
            chat.append(rng.choice(CODE_TEMPLATES).format(
                name=f.name, sig=f.signature, summary=f.summary, summary_l=s[:1].lower() + s[1:],
                module=f.module))
        elif kind < 0.88:
            f = rng.choice(funcs)
            chat.append(rng.choice(SNIPPET_TEMPLATES).format(code=_dedent(f.source)))
        else:
            chat.append(rng.choice(TOPIC_TEMPLATES).format(text=rng.choice(paragraphs)))
    return code, [[{"role": "user", "content": c}] for c in chat]


def usable_question(text: str) -> bool:
    """A self-written question worth answering: a sentence or more, not cut off mid-way by its budget."""
    return 12 <= len(text) <= 400 and text[-1] in ".?!:)\"'`"
