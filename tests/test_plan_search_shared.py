"""`gigatron plan --search` shares work between layouts (issue 38 item 14, issue 39): the
flags' settings built once, each stage's model state (parameter lists, ZeRO buffers) kept by
layout sizes, the zoo's files read once. The answer is the one each layout planned alone
gives, byte for byte: the text's top 10 and refusal summary, and every layout of the JSON.

Small versions of the zoo's MoE models (DeepSeek-V2-Lite's MLA and shared experts on an
uneven pipeline, gpt-oss's sinks and windows) and a dense Llama, on 4-8 H100s.
"""
import json

import pytest

from gigatron.cli import plan as plan_cli
from gigatron.models import zoo
from gigatron.training.plan import memory, report
from gigatron.training.plan import search as plan_search

CASES = {
    "deepseek-v2-lite": "--model deepseek-v2-lite --num-layers 3 --moe-layer-freq [0,1,1] --num-experts 8 "
                        "--num-gpus 4 --global-batch-size 16",
    "gpt-oss-20b": "--model gpt-oss-20b --num-layers 2 --num-experts 8 --num-gpus 4 "
                   "--global-batch-size 16",
    "llama3-8b": "--model llama3-8b --num-layers 4 --num-gpus 8 --global-batch-size 32",
}


def _configured(case: str):
    argv = f"--gpu h100-sxm --bf16 --search {CASES[case]}".split()
    opts, flags, run, tokenizer, world = plan_cli.configure(argv)
    return flags, world, run.train.global_batch_size, tokenizer, plan_cli._hardware(
        opts, run.logging.peak_tflops)


@pytest.fixture(scope="module")
def searched():
    """case -> (the search's arguments, its shared search's answer, the layout sizes of each
    stage model state built, the paths opened), configured and searched once per module
    (each search of these small models ~1-2 CPU-s): every test reads the one search."""
    cache = {}

    def get(case):
        if case not in cache:
            built, reads = [], []
            stage_state, real_open = memory._stage_state, open
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(memory, "_stage_state",
                              lambda *a: built.append(a[1:]) or stage_state(*a))
                patch.setattr("builtins.open", lambda path, *a, **k: reads.append(str(path))
                              or real_open(path, *a, **k))
                args = _configured(case)
                cache[case] = args, plan_search.search(*args), built, reads
        return cache[case]
    return get


def _answers(ranked, refused):
    return (report.describe_search(ranked, refused, 10),
            json.dumps(report.search_dict(ranked, refused), indent=1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_search_answers_byte_for_byte_as_each_layout_alone(searched, case):
    args, shared, _, _ = searched(case)
    alone = plan_search.search(*args, share=False)
    assert len(shared[0]) > 5 and len(shared[1]) > 5
    text, doc = _answers(*shared)
    want_text, want_doc = _answers(*alone)
    assert text == want_text
    assert doc == want_doc


def test_each_stages_model_state_is_built_once_per_layout_size(searched):
    """The parameter lists and ZeRO buffers depend on the sizes (tp, pp rank and split, ep,
    ZeRO stage and shards), not on the micro-batch, recomputation or schedule: 12 or more
    layouts share each (was: one build per stage of every layout)."""
    _, (ranked, refused), built, _ = searched("gpt-oss-20b")
    planned = len(ranked) + sum(not c.reason.startswith("--") for c in refused)
    assert len(built) == len({repr(key) for key in built})
    assert len(built) * 12 <= planned


def test_the_zoo_file_is_read_once_for_every_layout(searched):
    _, (ranked, refused), _, reads = searched("deepseek-v2-lite")
    assert len(ranked) + len(refused) > 100
    assert sum(path.endswith("deepseek-v2-lite.json") for path in reads) <= 1
    assert zoo.model_fields("deepseek-v2-lite") is not zoo.model_fields("deepseek-v2-lite")


@pytest.mark.parametrize("shape", [(1, 4, 1, "1f1b"), (4, 16, 1, "1f1b"), (4, 8, 2, "1f1b"),
                                   (4, 16, 1, "zb-h1"), (4, 16, 2, "zbv")])
def test_a_shape_replayed_as_code_gives_the_simulators_makespan_to_the_bit(shape):
    from gigatron.parallel.pipeline.simulate import run_step
    from gigatron.training.plan import schedules

    program = schedules._program(*shape)
    replay = schedules._replay(*shape)
    for forward, backward in ((1.0, 2.0), (0.0123, 0.0371), (3.3e-3, 7.1e-3), (0.7, 0.0)):
        want = run_step(program, forward, backward, backward / 2, timelines=False).makespan
        assert replay(forward, backward, backward - backward / 2, backward / 2) == want
        assert schedules.step_makespan(*shape[:3], forward, backward, shape[3]) == want
