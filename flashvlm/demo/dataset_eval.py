"""`flashvlm eval --dataset FILE.jsonl`: exact-match accuracy on the user's own labelled images.

One JSON object a line: `{"image": path, "question": str, "answer": str or [str, ...]}`, or `"images": [paths]`
for several images, and optionally `"type"` (or `"category"`) to get one accuracy row per type. Relative image
paths resolve against the file's folder (the rule of `flashvlm bench --dataset`). An answer is right when its
normalised text equals any accepted answer's.

The whole file (or, with a limit, the lines evaluated) is checked, images decoded included, before a model
loads, so a typo fails in a second with its file and line number instead of after a long run. A line the engine
still refuses at run time (a prompt longer than --max-model-len, an image changed since the check) is counted
wrong and listed under "errors" with its line number; the other lines are evaluated as usual.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashvlm.bench.workloads import jsonl_objects, resolve_dataset_image
from flashvlm.demo.evaluate import normalize
from flashvlm.processing.images import load_image
from flashvlm.request import InvalidRequestError, SamplingParams

FIELDS = ("image", "images", "question", "answer", "type", "category")
UNTYPED = "all"
"""The row of every line when no line has a type."""
UNTYPED_AMONG_TYPED = "untyped"
"""The row of the lines without a type when other lines have one."""
ANSWER_TOKEN_MARGIN = 8
"""Tokens allowed beyond the longest accepted answer by default: a trailing period, a space, an end token."""
MAX_SAMPLES = 10


class DatasetError(ValueError):
    """A dataset file that cannot be evaluated; the message names the file and, for a bad line, its number."""


@dataclass(frozen=True)
class DatasetExample:
    line: int
    images: list[str]
    question: str
    answers: list[str]
    qtype: str | None


def _strings(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _parse_line(path: Path, lineno: int, obj: dict[str, Any]) -> DatasetExample:
    where = f"{path}:{lineno}"
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise DatasetError(f"{where}: unknown field(s) {unknown}; allowed: {', '.join(FIELDS)}")
    if "image" in obj and "images" in obj:
        raise DatasetError(f"{where}: give 'image' (one path) or 'images' (a list), not both")
    if "image" in obj:
        if not isinstance(obj["image"], str) or not obj["image"]:
            raise DatasetError(f"{where}: 'image' must be a file path (a string)")
        paths = [obj["image"]]
    elif "images" in obj:
        if not _strings(obj["images"]):
            raise DatasetError(f"{where}: 'images' must be a non-empty list of file paths")
        paths = obj["images"]
    else:
        raise DatasetError(f"{where}: missing field 'image' (or 'images')")
    question = obj.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: " + ("missing field 'question'" if question is None
                                           else "'question' must be a non-empty string"))
    answer = obj.get("answer")
    if answer is None:
        raise DatasetError(f"{where}: missing field 'answer'")
    answers = [answer] if isinstance(answer, str) else answer
    if not _strings(answers):
        raise DatasetError(f"{where}: 'answer' must be a string or a non-empty list of strings, got {answer!r}")
    if not all(normalize(a) for a in answers):
        raise DatasetError(f"{where}: 'answer' {answer!r} is empty after normalisation")
    qtype = _qtype(obj, where)
    images = [_checked_image(path, p, where) for p in paths]
    return DatasetExample(lineno, images, question, list(answers), qtype)


def _qtype(obj: dict[str, Any], where: str) -> str | None:
    values = {obj[k] for k in ("type", "category") if k in obj}
    if any(not isinstance(v, str) or not v for v in values):
        raise DatasetError(f"{where}: 'type' / 'category' must be a non-empty string")
    if len(values) > 1:
        raise DatasetError(f"{where}: 'type' and 'category' disagree ({sorted(values)}); give one")
    return values.pop() if values else None


def _checked_image(dataset: Path, image: str, where: str) -> str:
    try:
        resolved = resolve_dataset_image(dataset, image, where)
    except ValueError as e:
        raise DatasetError(str(e)) from None
    try:
        load_image(resolved)
    except InvalidRequestError as e:
        raise DatasetError(f"{where}: image {image!r}: {e}") from None
    return resolved


def load_eval_dataset(path: str | Path, limit: int | None = None) -> list[DatasetExample]:
    """The examples of a dataset file (its first `limit` non-blank lines if given), every line checked and every
    image decoded; DatasetError naming the file and line at the first problem."""
    path = Path(path).expanduser()
    if limit is not None and limit < 1:
        raise DatasetError(f"--limit must be >= 1, got {limit}")
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}")
    if not path.is_file():
        raise DatasetError(f"dataset path is not a file: {path}")
    examples: list[DatasetExample] = []
    try:
        for lineno, obj in jsonl_objects(path):
            examples.append(_parse_line(path, lineno, obj))
            if limit is not None and len(examples) >= limit:
                break
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DatasetError(f"cannot read dataset file {path}: {e.strerror or e}") from None
    except DatasetError:
        raise
    except ValueError as e:  # a line that is not a JSON object, in the bench reader's words
        raise DatasetError(str(e)) from None
    if not examples:
        raise DatasetError(f"{path}: no examples in the file")
    return examples


def default_max_tokens(tokenizer: Any, examples: list[DatasetExample]) -> int:
    """Enough tokens for the longest accepted answer plus a margin: a longer output cannot match exactly, so
    stopping there loses no right answer and bounds a rambling model's time."""
    longest = max(len(tokenizer.encode(a, add_special_tokens=False)) for ex in examples for a in ex.answers)
    return longest + ANSWER_TOKEN_MARGIN


def _conversation(ex: DatasetExample) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "image", "image": p} for p in ex.images]
    content.append({"type": "text", "text": ex.question})
    return [{"role": "user", "content": content}]


def _answer_batch(llm: Any, chunk: list[DatasetExample], params: SamplingParams,
                  progress: bool) -> list[str | InvalidRequestError]:
    """Each example's output text, or the engine's refusal of that example alone (the batch is retried one by
    one when a request in it is refused, since a refusal aborts its whole batch)."""
    try:
        return [out.text for out in llm.chat([_conversation(ex) for ex in chunk], params, use_tqdm=progress)]
    except InvalidRequestError:
        if len(chunk) == 1:
            raise
    results: list[str | InvalidRequestError] = []
    for ex in chunk:
        try:
            results.append(llm.chat([_conversation(ex)], params)[0].text)
        except InvalidRequestError as e:
            results.append(e)
    return results


def _row_name(qtype: str | None, typed: bool) -> str:
    if qtype is not None:
        return qtype
    return UNTYPED_AMONG_TYPED if typed else UNTYPED


def evaluate_dataset(llm: Any, examples: list[DatasetExample], source: str, batch_size: int = 64,
                     max_tokens: int | None = None, progress: bool = False) -> dict[str, Any]:
    """Greedy answers through `llm.chat`, batch_size questions at a time, scored by exact match after
    normalisation; the result has the shape of `evaluate`'s (split = the dataset's path) plus max_tokens and
    errors (the lines the engine refused, counted wrong), and image_tokens / image_tokens_kept (of every picture
    submitted, as the vision tower yields them and as many as visual-token pruning left for the language model)."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if max_tokens is None:
        max_tokens = default_max_tokens(llm.get_tokenizer(), examples)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    typed = any(ex.qtype is not None for ex in examples)
    correct: dict[str, int] = defaultdict(int)
    total: dict[str, int] = {}  # insertion order: rows in order of first appearance
    mistakes: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    before = llm.engine.stats()
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        for ex, got in zip(chunk, _answer_batch(llm, chunk, params, progress)):
            row = _row_name(ex.qtype, typed)
            total[row] = total.get(row, 0) + 1
            expected: str | list[str] = ex.answers[0] if len(ex.answers) == 1 else ex.answers
            if isinstance(got, InvalidRequestError):
                errors.append({"line": ex.line, "error": str(got)})
            elif normalize(got) in {normalize(a) for a in ex.answers}:
                correct[row] += 1
            elif len(mistakes) < MAX_SAMPLES:
                mistakes.append({"line": ex.line, "question": ex.question, "expected": expected, "got": got})
    per_type = {t: {"correct": correct[t], "total": n, "accuracy": correct[t] / n} for t, n in total.items()}
    n = len(examples)
    return {"split": source, "num_examples": n, "accuracy": sum(correct.values()) / n, "per_type": per_type,
            "sample_mistakes": mistakes, "max_tokens": max_tokens, "errors": errors,
            **{key: llm.engine.stats()[key] - before[key] for key in ("image_tokens", "image_tokens_kept")}}


def format_errors(result: dict[str, Any]) -> str:
    """The lines refused at run time, one a line (empty when none)."""
    errors = result.get("errors") or []
    if not errors:
        return ""
    lines = [f"{len(errors)} line(s) refused by the engine, counted wrong:"]
    lines += [f"  line {e['line']}: {e['error']}" for e in errors[:MAX_SAMPLES]]
    if len(errors) > MAX_SAMPLES:
        lines.append(f"  ... and {len(errors) - MAX_SAMPLES} more (all in --json)")
    return "\n".join(lines)
