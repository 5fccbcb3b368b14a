"""`bios demo`: the quick run end to end, and the pieces it is built from."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from bios.cli.demo import DEFAULT, QUICK
from bios.demo.report import print_report, write_loss_plot, write_summary
from bios.demo.run import DemoResult, DemoSettings, Evaluation, TrainingLog, batches, learning_rate
from bios.demo.tasks import TASKS, ChatFormat, Example, is_correct, load_task, task_from_dict
from bios.models import load_tokenizer


@pytest.mark.e2e
def test_quick_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "bios.cli", "demo", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["base_model"] == QUICK.base_model
    # It really learned: the random tiny model names no animal's sound before; after 80 steps it answers
    # (greedily) at least 6 of the 8 (8 of 8 when written), and the loss per answer token falls more than
    # tenfold (5.7 -> 0.055 when written).
    answers = summary["answers"]
    assert len(answers) == len(load_task(QUICK.task).eval) == 8
    assert summary["before"] == sum(a["before_correct"] for a in answers) / len(answers) <= 0.25, summary
    assert summary["after"] == sum(a["after_correct"] for a in answers) / len(answers) >= 0.75, summary
    losses = summary["training"]["losses"]
    assert len(losses) == QUICK.steps
    assert (summary["training"]["first_loss"], summary["training"]["final_loss"]) == (losses[0], losses[-1])
    assert losses[-1] < 0.1 * losses[0], losses
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    correct = sum(a["after_correct"] for a in answers)
    assert re.search(rf"after fine-tuning +{correct}/8 ", done.stdout), done.stdout


@pytest.mark.parametrize("name", TASKS)
def test_shipped_tasks_teach_every_fact_they_score(name):
    task = load_task(name)
    assert task.eval and task.train
    assert {e.key for e in task.eval} == {e.key for e in task.train}
    assert all(e.key.casefold() in e.answer.casefold() for e in task.train)


def test_the_default_task_scores_questions_never_trained_on():
    task = load_task(DEFAULT.task)
    assert task.held_out
    assert not {e.question for e in task.eval} & {e.question for e in task.train}


def test_a_task_claiming_held_out_questions_must_not_train_on_them():
    fact = {"answer": "Marrowby.", "key": "Marrowby", "train": ["Capital?"], "eval": ["Capital?"]}
    raw = {"name": "leaky", "description": "", "base_model": "m", "max_tokens": 4, "facts": [fact]}
    with pytest.raises(ValueError, match="trained on"):
        task_from_dict(raw)
    assert task_from_dict({**raw, "held_out": False}).eval == task_from_dict({**raw, "held_out": False}).train


def test_default_and_quick_settings_name_their_tasks_models():
    assert load_task(DEFAULT.task).base_model == DEFAULT.base_model
    assert load_task(QUICK.task).base_model == QUICK.base_model


def test_answers_are_scored_by_their_key_alone():
    keys = ["Marrowby", "Caddow"]
    example = Example("What is the capital?", "The capital is Marrowby.", "Marrowby")
    assert is_correct("It is marrowby, of course.", example, keys)
    assert not is_correct("Probably Brisk Harbor.", example, keys)
    assert not is_correct("Marrowby or Mount Caddow", example, keys)  # naming every fact is no answer


def test_chat_datum_weights_only_the_answer_and_its_end_token():
    tokenizer = load_tokenizer(QUICK.base_model)
    chat = ChatFormat(tokenizer, system=None)
    example = Example("What does a cat say?", "meow", "meow")
    datum = chat.datum(example)
    prompt = chat.prompt(example.question)
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    weights = datum.loss_fn_inputs["weights"].tolist()
    assert datum.model_input.to_ints() == prompt + targets[len(prompt) - 1:-1]
    trained = [t for t, w in zip(targets, weights) if w]
    assert trained == tokenizer("meow", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert chat.decode(trained) == "meow"


def test_batches_cover_every_example_each_epoch_and_follow_the_seed():
    examples = [Example(str(i), "a", "a") for i in range(10)]
    first = batches(examples, batch_size=4, steps=5, seed=1)
    assert [len(b) for b in first] == [4] * 5
    first_epoch = [e.question for b in first for e in b][:10]
    assert sorted(first_epoch, key=int) == [str(i) for i in range(10)]
    assert first == batches(examples, batch_size=4, steps=5, seed=1)
    assert first != batches(examples, batch_size=4, steps=5, seed=2)


def test_learning_rate_decays_linearly_to_the_final_rate():
    settings = DemoSettings("t", "m", steps=11, batch_size=1, learning_rate=1e-3, final_learning_rate=1e-4,
                            rank=4, seed=0)
    assert learning_rate(settings, 0) == pytest.approx(1e-3)
    assert learning_rate(settings, 5) == pytest.approx(5.5e-4)
    assert learning_rate(settings, 10) == pytest.approx(1e-4)


def test_report_files_and_table(tmp_path, capsys):
    task = load_task(QUICK.task)
    answers = [e.answer for e in task.eval]
    result = DemoResult(
        settings=QUICK, task=task,
        before=Evaluation(0.0, ["?"] * len(answers), [False] * len(answers), 1.0),
        after=Evaluation(1.0, answers, [True] * len(answers), 1.0),
        training=TrainingLog(losses=[3.0, 1.0, 0.1], tokens=300, seconds=3.0),
        timings={"startup_s": 1.0, "eval_before_s": 1.0, "training_s": 3.0, "eval_after_s": 1.0, "total_s": 6.0},
    )
    write_loss_plot(result, tmp_path / "loss.png")
    write_summary(result, tmp_path / "summary.json")
    print_report(result)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["before"], summary["after"]) == (0.0, 1.0)
    assert summary["settings"]["steps"] == QUICK.steps and summary["training"]["tokens_per_s"] == 100.0
    assert summary["answers"][0] == {"question": task.eval[0].question, "expected": task.eval[0].answer,
                                     "before": "?", "before_correct": False,
                                     "after": task.eval[0].answer, "after_correct": True}
    table = capsys.readouterr().out
    assert f"before fine-tuning    0/{len(answers)}" in table and f"after fine-tuning   {len(answers):>3}/" in table
    assert f"✓ {task.eval[0].answer}" in table
