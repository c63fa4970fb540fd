"""Facts lesson 06 states about the course's own code, pinned here instead of read from source in the lesson.

Pitfall 16 runs `real_run(..., sync_mode="accumulate")` and calls it lesson 04's loop with
`accumulate()` around each micro-batch: each window read ahead by `itertools.islice` before its
first backward, and one `optimizer.step()` after the window. Pitfalls 13 and 14 launch through
`gaccum_course.gallery.notebook_launcher_results`, which must launch nothing where it cannot show them.
"""

import ast
import inspect
import textwrap

from gaccum_lib import accelerate_runs


def _loop_over_windows():
    """The `for` statement of `accelerate_train` that walks one epoch window by window."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(accelerate_runs.accelerate_train)))
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For) and ast.unparse(node.target) == "_update"]
    assert len(loops) == 1
    return loops[0]


def test_real_run_reads_each_window_ahead_before_its_first_backward():
    body = _loop_over_windows().body
    reads = [i for i, node in enumerate(body) if "itertools.islice(batches, grad_accum_steps)" in ast.unparse(node)]
    backwards = [i for i, node in enumerate(body) if "accelerator.backward" in ast.unparse(node)]
    assert reads and backwards and reads[0] < backwards[0]  # the whole window is fetched first


def test_real_run_wraps_each_micro_batch_in_the_sync_context_and_steps_once_after_the_window():
    body = _loop_over_windows().body
    inner = [i for i, node in enumerate(body) if isinstance(node, ast.For) and "enumerate(window)" in ast.unparse(node)]
    assert len(inner) == 1
    micro_batch_loop = body[inner[0]]
    assert isinstance(micro_batch_loop.body[0], ast.With)
    assert ast.unparse(micro_batch_loop.body[0].items[0].context_expr).startswith("_sync_context(sync_mode")
    after = [ast.unparse(node) for node in body[inner[0] + 1:]]
    assert "optimizer.step()" in after and "optimizer.step()" not in ast.unparse(micro_batch_loop)


class _Accelerator:
    num_processes = 2

    def accumulate(self, model):
        return ("accumulate", model)


def test_the_accumulate_sync_mode_is_accelerator_accumulate_for_every_micro_batch():
    model = object()
    for is_last in (False, True):
        assert accelerate_runs._sync_context("accumulate", _Accelerator(), model, is_last=is_last) == \
            ("accumulate", model)


def test_the_gallery_launch_starts_nothing_where_notebook_launcher_would_not_fork(monkeypatch, capsys):
    import gaccum_launch
    from gaccum_course.gallery import notebook_launcher_results

    def must_not_run():
        raise AssertionError("launched")

    monkeypatch.setattr(gaccum_launch, "notebook_launcher_forks", lambda: False)  # a Colab kernel below 2 GPUs
    assert notebook_launcher_results(must_not_run) is None
    assert "notebook_launcher starts no process in this kernel: nothing to show here" in capsys.readouterr().out
    monkeypatch.setattr(gaccum_launch, "notebook_launcher_forks", lambda: True)
    monkeypatch.setattr(gaccum_launch, "gpu_count", lambda: 1)  # pitfall 13 needs a machine without GPUs
    assert notebook_launcher_results(must_not_run, needs_no_gpu=True) is None
    assert "this machine has a GPU" in capsys.readouterr().out


def test_the_refusal_helper_says_nothing_to_show_where_notebook_launcher_would_not_fork(monkeypatch, capsys):
    import gaccum_launch
    from gaccum_course.gallery import notebook_launcher_refusal

    def must_not_run():
        raise AssertionError("launched")

    monkeypatch.setattr(gaccum_launch, "notebook_launcher_forks", lambda: False)  # a Colab kernel below 2 GPUs
    assert notebook_launcher_refusal(must_not_run) is None
    assert "nothing to show here" in capsys.readouterr().out
