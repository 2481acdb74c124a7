"""dev.batch_invariance: it finds what a row does among other rows, and finds it when it changes."""

from __future__ import annotations

import torch

from dev.batch_invariance import ModelShape, classes, markdown, model_classes, product_row, spans


def test_rows_among_sixteen_to_sixty_four_agree_on_this_cpu_and_never_depend_on_the_others():
    """From 16 rows on both CPUs measured (AMD EPYC: from 4; Intel Xeon: from 16, pipespec.stages.invariance)."""
    row, results = product_row("q/o 1024x1024", torch.float32, 1, [16, 32, 64], repeats=1)
    assert row.classes == "16-64" and row.content_invariant
    assert set(results) == {16, 32, 64} and all(ms > 0 for ms in row.ms.values())


def test_a_product_that_changes_with_the_row_count_or_the_other_rows_is_found_out():
    by_count = lambda x, w: torch.nn.functional.linear(x, w) + 1e-3 * len(x)  # noqa: E731
    row, _ = product_row("q/o 1024x1024", torch.float32, 1, [4, 8, 16], 1, product=by_count)
    assert row.classes == "4 / 8 / 16" and row.content_invariant
    by_others = lambda x, w: torch.nn.functional.linear(x - x.mean(0), w)  # noqa: E731
    row, _ = product_row("q/o 1024x1024", torch.float32, 1, [4, 8], 1, product=by_others)
    assert not row.content_invariant


def test_classes_group_equal_results_and_spans_name_them():
    a, b = torch.zeros(2), torch.ones(2)
    rows = [1, 2, 3, 4, 64]
    groups = classes(rows, {1: a, 2: b, 3: b, 4: b, 64: a})
    assert groups == [[1, 64], [2, 3, 4]] and spans(rows, groups) == "1,64 / 2-4"


def test_a_model_sequence_among_others_and_the_table(tmp_path):
    shape = ModelShape(hidden=64, heads=4, intermediate=128, vocab=256, length=8)
    got = model_classes(shape, torch.float32, 1, [1, 2, 4])
    assert got["content_invariant"] and got["classes"].count("/") <= 2 and set(got.pop("logits")) == {1, 2, 4}
    table = markdown({"rows": [4], "products": [], "models": [{"dtype": "float32", "threads": 1, **got}], "torch": "x"})
    assert f"| float32 | 1 | {got['classes']} | yes | - |" in table


def test_a_target_stage_answers_alike_on_one_thread_and_two():
    from dev.batch_invariance import stage_threads

    assert stage_threads("Llama, hidden 1024", "bfloat16", prompt=20)
