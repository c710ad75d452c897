"""`flashvlm eval --dataset FILE.jsonl` on the embedded demo model: scores equal an independent count of exact
matches from `LLM.chat`, and every bad input is one clear error (exit code 2) before a model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashvlm import LLM, SamplingParams
from flashvlm.cli import main
from flashvlm.demo.dataset_eval import ANSWER_TOKEN_MARGIN, evaluate_dataset, format_errors, load_eval_dataset
from flashvlm.demo.scenes import SPLIT_SEEDS, make_example

NUM_EXAMPLES = 12


def _norm(text: str) -> str:
    # Written out again here (not imported) so the test checks the rule, not the function against itself.
    return " ".join(text.strip().strip(".").split()).lower()


def _write(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def scenes_dir(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Twelve test-split scenes saved as PNG in a folder, and their JSONL rows (paths relative to the folder)."""
    folder = tmp_path_factory.mktemp("scenes")
    (folder / "img").mkdir()
    rows = []
    for i in range(NUM_EXAMPLES):
        ex = make_example(SPLIT_SEEDS["test"], i)
        name = f"img/scene{i}.png"
        ex.image.save(folder / name)
        row: dict = {"image": name, "question": ex.question, "answer": ex.answer, "type": ex.qtype}
        if i == 1:
            row["answer"] = ["zzz", f"  {ex.answer.upper()}."]  # any accepted answer counts, normalised too
        if i == 2:
            row["answer"] = ["zzz", "yyy"]  # surely wrong: a mistake to report
        if i == 5:
            del row["image"]
            row["images"] = [name, str((folder / name).resolve())]  # several images, an absolute path
        if i == 6:
            del row["type"]
            row["category"] = ex.qtype
        rows.append(row)
    return folder, rows


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", kv_cache_tokens=4096)


def _independent_scores(llm: LLM, folder: Path, rows: list[dict], max_tokens: int) -> dict[str, list[int]]:
    """type -> [correct, total], from LLM.chat answers one by one and the test's own normalisation."""
    scores: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for row in rows:
        paths = row.get("images", [row.get("image")])
        content = [{"type": "image", "image": str(folder / p)} for p in paths]
        content.append({"type": "text", "text": row["question"]})
        text = llm.chat([{"role": "user", "content": content}], params)[0].text
        answers = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
        qtype = row.get("type", row.get("category", "all"))
        score = scores.setdefault(qtype, [0, 0])
        score[0] += _norm(text) in {_norm(a) for a in answers}
        score[1] += 1
    return scores


def test_dataset_eval_matches_an_independent_count(scenes_dir, llm, tmp_path, capsys) -> None:
    folder, rows = scenes_dir
    data = _write(folder / "mine.jsonl", rows[:4] + [""] + rows[4:])  # a blank line is skipped
    out = tmp_path / "result.json"
    assert main(["eval", "--dataset", str(data), "--device", "cpu", "--batch-size", "5", "--json", str(out)]) == 0
    report = capsys.readouterr().out
    result = json.loads(out.read_text())
    tok = llm.get_tokenizer()
    answers = [a for r in rows for a in (r["answer"] if isinstance(r["answer"], list) else [r["answer"]])]
    longest = max(len(tok.encode(a, add_special_tokens=False)) for a in answers)
    assert result["max_tokens"] == longest + ANSWER_TOKEN_MARGIN
    expected = _independent_scores(llm, folder, rows, result["max_tokens"])
    assert result["split"] == str(data) and result["num_examples"] == NUM_EXAMPLES and result["errors"] == []
    assert {t: [r["correct"], r["total"]] for t, r in result["per_type"].items()} == expected
    assert list(result["per_type"]) == ["colour", "count", "position", "text"]  # order of first appearance
    right = sum(c for c, _ in expected.values())
    assert result["accuracy"] == pytest.approx(right / NUM_EXAMPLES)
    assert right >= NUM_EXAMPLES - 3  # real labelled scenes: the demo model answers most (one line is surely wrong)
    mistake = next(m for m in result["sample_mistakes"] if m["line"] == 3)  # the surely wrong answer list
    assert mistake["question"] == rows[2]["question"] and mistake["expected"] == ["zzz", "yyy"]
    assert "overall" in report and "text" in report


def test_limit_takes_the_first_lines_and_untyped_files_get_one_row(scenes_dir, llm, tmp_path) -> None:
    folder, rows = scenes_dir
    untyped = [{k: v for k, v in r.items() if k not in ("type", "category")} for r in rows]
    data = _write(folder / "untyped.jsonl", untyped)
    out = tmp_path / "result.json"
    assert main(["eval", "--dataset", str(data), "--limit", "5", "--max-tokens", "6", "--device", "cpu",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["max_tokens"] == 6 and result["num_examples"] == 5
    expected = _independent_scores(llm, folder, untyped[:5], 6)
    assert {t: [r["correct"], r["total"]] for t, r in result["per_type"].items()} == expected
    assert list(expected) == ["all"]


def test_a_line_refused_at_run_time_is_counted_wrong_and_the_rest_evaluated(scenes_dir, llm, tmp_path) -> None:
    folder, rows = scenes_dir
    for i in range(3):
        (tmp_path / f"scene{i}.png").write_bytes((folder / rows[i]["image"]).read_bytes())
    picked = [dict(rows[i], image=f"scene{i}.png") for i in range(3)]
    del picked[2]["type"]  # untyped among typed lines: its own row
    examples = load_eval_dataset(_write(tmp_path / "d.jsonl", picked))
    (tmp_path / "scene1.png").write_bytes(b"no longer a PNG")  # changed after the check
    result = evaluate_dataset(llm, examples, "d.jsonl", batch_size=3, max_tokens=6)
    assert [e["line"] for e in result["errors"]] == [2] and "cannot decode" in result["errors"][0]["error"]
    good = [picked[0], picked[2]]
    expected = _independent_scores(llm, tmp_path, good, 6)  # the refused line scores nothing
    assert {t: r["total"] for t, r in result["per_type"].items()} == {"colour": 1, "count": 1, "untyped": 1}
    assert sum(r["correct"] for r in result["per_type"].values()) == sum(c for c, _ in expected.values())
    assert "line 2:" in format_errors(result)


def test_the_result_counts_the_image_tokens_pruning_kept(scenes_dir, llm) -> None:
    folder, rows = scenes_dir
    examples = load_eval_dataset(_write(folder / "pruned.jsonl", rows[:3]))
    full = evaluate_dataset(llm, examples, "pruned.jsonl", max_tokens=4)
    pruned_llm = LLM(device="cpu", kv_cache_tokens=4096, mm_token_pruning="pool", mm_token_keep_ratio=0.25)
    pruned = evaluate_dataset(pruned_llm, examples, "pruned.jsonl", max_tokens=4)
    assert full["image_tokens"] == full["image_tokens_kept"] == pruned["image_tokens"] > 0
    per_image = full["image_tokens"] // 3
    assert pruned["image_tokens_kept"] == 3 * -(-per_image // 4)


def test_the_cli_reports_a_prompt_too_long_for_the_engine_and_goes_on(scenes_dir, tmp_path, capsys) -> None:
    folder, rows = scenes_dir
    long_question = dict(rows[1], question="Please look closely. " * 40 + rows[1]["question"])
    data = _write(folder / "long.jsonl", [rows[0], long_question, rows[3]])
    out = tmp_path / "result.json"
    assert main(["eval", "--dataset", str(data), "--max-model-len", "160", "--device", "cpu",
                 "--json", str(out)]) == 0
    report = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [e["line"] for e in result["errors"]] == [2] and "max_model_len is 160" in result["errors"][0]["error"]
    assert result["num_examples"] == 3 and sum(r["total"] for r in result["per_type"].values()) == 3
    assert "1 line(s) refused by the engine, counted wrong:" in report and "line 2: prompt is" in report


def _bad_inputs(folder: Path, rows: list[dict]) -> list[tuple[str, list[dict | str], str]]:
    good = rows[0]
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n but then nothing")
    return [
        ("not_json", [good, "{'image': 'x.png'}"], ":2: invalid JSON"),
        ("not_object", [good, "[1, 2]"], ":2: each line must be a JSON object"),
        ("no_question", [good, good, {k: v for k, v in good.items() if k != "question"}],
         ":3: missing field 'question'"),
        ("no_answer", [{k: v for k, v in good.items() if k != "answer"}], ":1: missing field 'answer'"),
        ("no_image", [{k: v for k, v in good.items() if k != "image"}], ":1: missing field 'image'"),
        ("answer_not_string", [dict(good, answer=3)], ":1: 'answer' must be a string or a non-empty list"),
        ("empty_answers", [dict(good, answer=[])], ":1: 'answer' must be a string or a non-empty list"),
        ("missing_image", [good, dict(good, image="img/nope.png")], ":2: image 'img/nope.png' not found"),
        ("undecodable", [dict(good, image="broken.png")], ":1: image 'broken.png': cannot decode"),
        ("unknown_field", [dict(good, answr="red")], ":1: unknown field(s) ['answr']"),
        ("both_image_fields", [dict(good, images=[good["image"]])], ":1: give 'image' (one path) or 'images'"),
        ("types_disagree", [dict(good, category="other")], ":1: 'type' and 'category' disagree"),
        ("empty_file", ["", "  "], ": no examples in the file"),
    ]


def test_bad_input_is_one_clear_error_before_any_model_loads(scenes_dir, monkeypatch, capsys) -> None:
    folder, rows = scenes_dir

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded for a dataset that cannot be evaluated")

    monkeypatch.setattr(LLM, "from_config", no_model)
    for name, lines, message in _bad_inputs(folder, rows):
        data = _write(folder / f"{name}.jsonl", lines)
        assert main(["eval", "--dataset", str(data), "--device", "cpu"]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: {data}") and message in err and "Traceback" not in err, (name, err)
        assert err.count("\n") == 1, (name, err)  # one line
    good = _write(folder / "good.jsonl", rows[:2])
    cases = [
        (["--dataset", str(folder / "absent.jsonl")], "dataset file not found"),
        (["--dataset", str(folder)], "dataset path is not a file"),
        (["--dataset", str(good), "--limit", "0"], "--limit must be >= 1"),
        (["--dataset", str(good), "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--dataset", str(good), "--num-examples", "5"], "--split and --num-examples choose scenes"),
        (["--limit", "5"], "--limit applies to --dataset"),
    ]
    for argv, message in cases:
        assert main(["eval", *argv, "--device", "cpu"]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


def test_a_limit_reads_only_the_lines_it_evaluates(scenes_dir) -> None:
    folder, rows = scenes_dir
    data = _write(folder / "late_error.jsonl", rows[:2] + ["not json"])
    assert [ex.line for ex in load_eval_dataset(data, limit=2)] == [1, 2]
    with pytest.raises(ValueError, match=":3: invalid JSON"):
        load_eval_dataset(data)
