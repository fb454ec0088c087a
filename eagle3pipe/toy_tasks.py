"""Generated task mix for the toy reasoning verifier: questions, step-by-step working, short answers.

Each task is a small reasoning job a model can learn to do exactly with a fixed procedure — multi-digit addition
and subtraction (column method with carries/borrows), multiplication (split into tens and ones), sorting
(repeatedly take the smallest), counting a letter in a word (letter by letter), and unit conversion — asked with
varied phrasing. A sample holds three texts:

- ``question``: the user turn;
- ``reasoning``: the working the verifier is trained to write inside ``<think>...</think>``;
- ``answer``: the verifier's short visible answer;

plus ``human_answer``, a differently worded answer as a person would write it with no working shown. That last one
is what the chat dataset for stage 01 holds, so a draft trained on it (human-written data) sees text unlike the
verifier's own output, which is the premise the quality experiment measures.

Everything is drawn from ``random.Random(seed)``: the same seed gives the same samples, byte for byte.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

TASK_KINDS = ("add", "subtract", "multiply", "sort", "count", "convert")


@dataclass(frozen=True)
class Task:
    kind: str
    question: str
    reasoning: str
    answer: str
    human_answer: str
    result: str  # the bare result (number or comma-separated list), for checking

    def to_json(self) -> dict:
        return asdict(self)


PLACE_NAMES = ["ones", "tens", "hundreds", "thousands", "ten-thousands"]


def _digits(n: int) -> list[int]:
    """Digits of ``n``, least significant first."""
    return [int(c) for c in reversed(str(n))]


def _add(rng: random.Random) -> Task:
    a = rng.randint(10, 9999)
    b = rng.randint(10, 9999)
    q = rng.choice([
        "What is {a} + {b}?",
        "Compute {a} plus {b}.",
        "Add {a} and {b}.",
        "What is the sum of {a} and {b}?",
        "Please work out {a} + {b}.",
    ]).format(a=a, b=b)
    da, db = _digits(a), _digits(b)
    steps = [f"I need to add {a} and {b}. I will add column by column, starting from the ones."]
    carry = 0
    for i in range(max(len(da), len(db))):
        x = da[i] if i < len(da) else 0
        y = db[i] if i < len(db) else 0
        s = x + y + carry
        carry_text = f" + {carry}" if carry else ""
        line = f"{PLACE_NAMES[i].capitalize()}: {x} + {y}{carry_text} = {s}"
        line += f", write {s % 10} and carry 1." if s >= 10 else f", write {s}."
        steps.append(line)
        carry = s // 10
    if carry:
        steps.append("The last carry 1 becomes the leading digit.")
    steps.append(f"So {a} + {b} = {a + b}.")
    return Task("add", q, "\n".join(steps), f"{a} + {b} = {a + b}.",
                rng.choice([f"It's {a + b}.", f"{a + b}", f"The sum is {a + b}."]), str(a + b))


def _subtract(rng: random.Random) -> Task:
    a = rng.randint(100, 9999)
    b = rng.randint(10, a - 1)
    q = rng.choice([
        "What is {a} - {b}?",
        "Compute {a} minus {b}.",
        "Subtract {b} from {a}.",
        "What is the difference between {a} and {b}?",
    ]).format(a=a, b=b)
    da, db = _digits(a), _digits(b)
    steps = [f"I need {a} - {b}. I will subtract column by column, starting from the ones."]
    borrow = 0
    for i in range(len(da)):
        x = da[i] - borrow
        y = db[i] if i < len(db) else 0
        if x < y:
            steps.append(f"{PLACE_NAMES[i].capitalize()}: {x} is less than {y}, so borrow 1: {x + 10} - {y} = {x + 10 - y}.")
            borrow = 1
        else:
            steps.append(f"{PLACE_NAMES[i].capitalize()}: {x} - {y} = {x - y}.")
            borrow = 0
    steps.append(f"So {a} - {b} = {a - b}.")
    return Task("subtract", q, "\n".join(steps), f"{a} - {b} = {a - b}.",
                rng.choice([f"{a - b}", f"The difference is {a - b}.", f"That leaves {a - b}."]), str(a - b))


def _multiply(rng: random.Random) -> Task:
    a = rng.randint(12, 99)
    b = rng.randint(3, 99)
    q = rng.choice([
        "What is {a} * {b}?",
        "Compute {a} times {b}.",
        "Multiply {a} by {b}.",
        "What is the product of {a} and {b}?",
    ]).format(a=a, b=b)
    tens, ones = (b // 10) * 10, b % 10
    steps = [f"I need {a} * {b}. Split {b} into {tens} + {ones}." if tens and ones
             else f"I need {a} * {b}."]
    parts = []
    for part in (tens, ones):
        if part:
            steps.append(f"{a} * {part} = {a * part}.")
            parts.append(a * part)
    if len(parts) == 2:
        steps.append(f"Add the parts: {parts[0]} + {parts[1]} = {a * b}.")
    steps.append(f"So {a} * {b} = {a * b}.")
    return Task("multiply", q, "\n".join(steps), f"{a} * {b} = {a * b}.",
                rng.choice([f"{a * b}", f"The product is {a * b}.", f"{a} x {b} is {a * b}."]), str(a * b))


def _sort(rng: random.Random) -> Task:
    n = rng.randint(4, 7)
    values = rng.sample(range(1, 200), n)
    descending = rng.random() < 0.3
    listed = ", ".join(map(str, values))
    order = "descending" if descending else "ascending"
    q = rng.choice([
        "Sort these numbers in {order} order: {v}.",
        "Put the following numbers in {order} order: {v}",
        "Arrange {v} from {word}.",
    ]).format(order=order, v=listed, word="largest to smallest" if descending else "smallest to largest")
    pick = "largest" if descending else "smallest"
    remaining = list(values)
    steps = [f"I will sort {listed} in {order} order by taking the {pick} remaining number each time."]
    out = []
    while remaining:
        x = max(remaining) if descending else min(remaining)
        remaining.remove(x)
        out.append(x)
        rest = ", ".join(map(str, remaining)) if remaining else "nothing"
        steps.append(f"The {pick} of the remaining is {x}. Left: {rest}.")
    result = ", ".join(map(str, out))
    steps.append(f"So the sorted list is {result}.")
    return Task("sort", q, "\n".join(steps), f"Sorted: {result}.",
                rng.choice([f"{result}", f"In order: {result}", f"[{result}]"]), result)


COUNT_WORDS = [
    "strawberry", "banana", "mississippi", "excellence", "committee", "bookkeeper", "parallel", "assessment",
    "programming", "reasoning", "tomorrow", "successful", "occurrence", "necessary", "accommodate", "balloon",
    "coffee", "letter", "possession", "embarrass", "address", "referral", "millennium", "pepper",
]


def _count(rng: random.Random) -> Task:
    word = rng.choice(COUNT_WORDS)
    letter = rng.choice(sorted(set(word)) + [rng.choice("aeiou")])
    q = rng.choice([
        "How many times does the letter '{l}' appear in '{w}'?",
        "Count the letter {l} in the word {w}.",
        "How many {l}'s are in \"{w}\"?",
    ]).format(l=letter, w=word)
    steps = [f"I will go through '{word}' letter by letter and count '{letter}'."]
    count = 0
    for i, c in enumerate(word, 1):
        if c == letter:
            count += 1
            steps.append(f"Letter {i} is {c}: a match, count {count}.")
        else:
            steps.append(f"Letter {i} is {c}.")
    steps.append(f"So '{letter}' appears {count} times.")
    return Task("count", q, "\n".join(steps), f"{count}",
                rng.choice([f"{count}", f"There are {count}.", f"{count} times."]), str(count))


# (unit, smaller unit, factor): 1 unit = factor smaller units
CONVERSIONS = [
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("kilograms", "grams", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("liters", "milliliters", 1000),
    ("days", "hours", 24),
]


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _convert(rng: random.Random) -> Task:
    big, small, factor = rng.choice(CONVERSIONS)
    if rng.random() < 0.6:
        value = rng.randint(1, 40) + rng.choice([0, 0, 0.5, 0.25])
        src, dst, result = big, small, value * factor
        rule, op = f"1 {big[:-1]} is {factor} {small}", f"multiply by {factor}: {_fmt(value)} * {factor}"
    else:
        value = factor * rng.randint(1, 40) + rng.choice([0, factor // 2])
        src, dst, result = small, big, value / factor
        rule, op = f"1 {big[:-1]} is {factor} {small}", f"divide by {factor}: {_fmt(value)} / {factor}"
    q = rng.choice([
        "Convert {v} {s} to {d}.",
        "How many {d} are in {v} {s}?",
        "What is {v} {s} in {d}?",
    ]).format(v=_fmt(value), s=src, d=dst)
    steps = [f"I need to convert {_fmt(value)} {src} to {dst}.", f"{rule}.", f"So {op} = {_fmt(result)}."]
    return Task("convert", q, "\n".join(steps), f"{_fmt(value)} {src} is {_fmt(result)} {dst}.",
                rng.choice([f"{_fmt(result)} {dst}", f"That's {_fmt(result)} {dst}.", f"{_fmt(result)}"]),
                _fmt(result))


GENERATORS = {"add": _add, "subtract": _subtract, "multiply": _multiply, "sort": _sort, "count": _count,
              "convert": _convert}


def generate_tasks(n: int, seed: int) -> list[Task]:
    """``n`` tasks, kinds drawn uniformly, all from ``random.Random(seed)`` (deterministic)."""
    rng = random.Random(seed)
    return [GENERATORS[rng.choice(TASK_KINDS)](rng) for _ in range(n)]


def verifier_messages(task: Task) -> list[dict]:
    """The conversation the verifier is trained on: question, then reasoning (inside <think>) and short answer."""
    return [{"role": "user", "content": task.question},
            {"role": "assistant", "content": task.answer, "reasoning_content": task.reasoning}]


def human_chat_row(task: Task, row_id: str) -> dict:
    """One row of the human-written chat dataset (stage 01 input): OpenAI ``messages`` with role/content only."""
    return {"id": row_id, "messages": [{"role": "user", "content": task.question},
                                       {"role": "assistant", "content": task.human_answer}]}
