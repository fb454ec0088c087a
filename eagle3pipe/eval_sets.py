"""Stage 05's prompt sets: the benchmarks the field reports acceptance length on, and local prompt files.

``evaluate.benchmarks`` entries, each one row of the report:

- ``mtbench`` / ``gsm8k`` / ``humaneval`` / ``math500``: a known set (``KNOWN_SETS``), loaded from the Hugging Face
  hub with ``datasets`` (dataset id, config, split and the field holding the question, as each dataset card gives
  them);
- ``NAME=FILE`` with a known NAME: that set's schema read from a local ``.jsonl`` / ``.parquet`` file (an offline
  copy, e.g. ``load_dataset("openai/gsm8k", "main", split="test").to_json("gsm8k.jsonl")``);
- ``FILE`` or ``NAME=FILE`` otherwise: a JSONL chat file (``messages`` / ``conversations``, cut at the last user
  turn), like ``--prompts``.

Every set gives ``evaluate.num_prompts`` prompts, chosen by ``shared.seed`` (the same on every run), so rows of the
report weigh alike; a smaller set is an error rather than a silently thinner row. Each prompt is a list of chat
messages: the server renders it with the verifier's own chat template (the chat endpoint), thinking as
``shared.thinking`` says.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from .chat import ChatError, normalize_messages, question_messages
from .cli import StageError
from .records import FormatError, read_jsonl

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class KnownSet:
    """Where a benchmark's questions live on the hub (checked against each dataset card, docs/stages/05_evaluate.md)."""

    dataset: str  # Hugging Face dataset id
    config: str | None  # dataset config name (None: the default one)
    split: str  # split holding the benchmark questions
    field: str  # column holding the question text
    first_turn: bool  # the column holds a list of turns (MT-Bench): send the first one
    size: int  # rows in that split, from the card (for the README and the log)


KNOWN_SETS: dict[str, KnownSet] = {
    # MT-Bench by LMSYS, 80 two-turn questions; `prompt` is the list of turns (the card renames `turns` to it)
    "mtbench": KnownSet("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", True, 80),
    # grade-school math word problems; configs main / socratic share `question`, `answer`
    "gsm8k": KnownSet("openai/gsm8k", "main", "test", "question", False, 1319),
    # 164 Python problems: `prompt` is the function signature and docstring
    "humaneval": KnownSet("openai/openai_humaneval", None, "test", "prompt", False, 164),
    # the 500 MATH problems of OpenAI's PRM800K split: `problem`, `solution`, `answer`, `subject`, `level`
    "math500": KnownSet("HuggingFaceH4/MATH-500", None, "test", "problem", False, 500),
}


@dataclass
class EvalSet:
    """One prompt set, loaded: its report row name, where it came from, and the chosen prompts."""

    name: str
    source: str  # hub id (with config and split) or file path, for the report
    prompts: list[dict]  # {"id", "messages"} in the order sent
    size: int  # prompts the source holds, before choosing


def parse_benchmark(spec: str) -> tuple[str, KnownSet | None, Path | None]:
    """(row name, known set or None, local file or None) of one ``evaluate.benchmarks`` entry; raises StageError
    for an entry that is neither a known set nor a file."""
    name, sep, path = spec.partition("=")
    if sep:
        if not name or not path:
            raise StageError(f"evaluate.benchmarks entry {spec!r}: write NAME=FILE (e.g. gsm8k=gsm8k_test.jsonl)")
        return name, KNOWN_SETS.get(name), Path(path)
    if spec in KNOWN_SETS:
        return spec, KNOWN_SETS[spec], None
    if Path(spec).suffix in LOCAL_FORMATS:
        return Path(spec).stem, None, Path(spec)
    raise StageError(f"evaluate.benchmarks: unknown set {spec!r} (known: {', '.join(KNOWN_SETS)}; or NAME=FILE with "
                     "a local .jsonl/.parquet file in a known set's schema, or a JSONL chat file)")


def load_known_rows(known: KnownSet, path: Path | None, where: str) -> list[str]:
    """The question texts of a known set, from the hub or from a local file in the same schema, via ``datasets``."""
    import datasets

    try:
        if path is not None:
            if path.suffix not in LOCAL_FORMATS:
                raise StageError(f"{where}: {path} is not a .jsonl/.json/.parquet file")
            if not path.is_file():
                raise StageError(f"{where}: file not found: {path}")
            ds = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(known.dataset, known.config, split=known.split)
    except StageError:
        raise
    except Exception as e:  # offline, unknown id, unreadable file: one line naming the set
        raise StageError(f"{where}: datasets could not load it ({type(e).__name__}: {str(e).splitlines()[0]})") \
            from None
    if known.field not in ds.column_names:
        raise StageError(f"{where}: no field {known.field!r} (columns: {', '.join(ds.column_names) or 'none'}); "
                         f"the known set's schema is {known.dataset}'s")
    questions = []
    for i, value in enumerate(ds[known.field]):
        if known.first_turn:
            value = value[0] if isinstance(value, list) and value else None
        if not isinstance(value, str) or not value.strip():
            raise StageError(f"{where}: row {i} has no question text in {known.field!r} (got {value!r:.80})")
        questions.append(value)
    return questions


def load_chat_prompts(path: Path) -> list[dict]:
    """Every prompt of a JSONL chat file (``messages`` / ``conversations``), cut at the last user turn."""
    if not path.is_file():
        raise FileNotFoundError(f"evaluation prompts not found: {path} (flag --prompts or evaluate.benchmarks)")
    prompts = []
    for i, row in enumerate(read_jsonl(path), 1):
        try:
            messages = question_messages(normalize_messages(row))
        except ChatError as e:
            raise FormatError(f"{path}:{i}: {e}") from None
        prompts.append({"id": str(row.get("id", f"line-{i}")), "messages": messages})
    return prompts


def choose(prompts: list[dict], num: int, seed: int, where: str) -> list[dict]:
    """``num`` prompts chosen by ``seed`` (kept in file order); the whole set when ``num`` is 0."""
    if not prompts:
        raise StageError(f"{where}: the set is empty")
    if num == 0 or num == len(prompts):
        return list(prompts)
    if num > len(prompts):
        raise StageError(f"{where}: {len(prompts)} prompts, evaluate.num_prompts asks {num} from every set: lower "
                         "--num-prompts (every row of the report gets the same number)")
    keep = sorted(random.Random(seed).sample(range(len(prompts)), num))
    return [prompts[i] for i in keep]


def load_eval_set(spec: str, num_prompts: int, seed: int) -> EvalSet:
    """One ``evaluate.benchmarks`` entry, loaded and chosen; every problem is a StageError naming the entry."""
    name, known, path = parse_benchmark(spec)
    where = f"evaluate.benchmarks {spec!r}"
    if known is not None:
        questions = load_known_rows(known, path, where)
        prompts = [{"id": f"{name}-{i}", "messages": [{"role": "user", "content": q}]}
                   for i, q in enumerate(questions)]
        source = str(path) if path is not None else \
            f"{known.dataset}" + (f" ({known.config})" if known.config else "") + f" split {known.split}"
    else:
        try:
            prompts = load_chat_prompts(path)
        except (FileNotFoundError, FormatError) as e:
            raise StageError(f"{where}: {e}") from None
        source = str(path)
    return EvalSet(name=name, source=source, prompts=choose(prompts, num_prompts, seed, where), size=len(prompts))


def load_eval_sets(benchmarks: list[str], prompts_file: str, num_prompts: int, seed: int) -> list[EvalSet]:
    """Every set of a run: ``--prompts`` (one chat file, its row named after the file) and then the benchmarks;
    loaded before any server starts, so a bad entry costs no server start."""
    sets = []
    if prompts_file:
        where = f"--prompts {prompts_file}"
        try:
            prompts = load_chat_prompts(Path(prompts_file))
        except (FileNotFoundError, FormatError) as e:
            raise StageError(str(e)) from None
        sets.append(EvalSet(name=Path(prompts_file).stem, source=prompts_file, size=len(prompts),
                            prompts=choose(prompts, num_prompts, seed, where)))
    sets += [load_eval_set(spec, num_prompts, seed) for spec in benchmarks]
    names = [s.name for s in sets]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise StageError(f"evaluate.benchmarks: two sets named {', '.join(dupes)}: name them apart with NAME=FILE")
    return sets
