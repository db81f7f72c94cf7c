"""`gigatron plan`: the report, --json, --search and its refusals, and bad input."""
import json

import pytest

from gigatron.cli import plan as plan_cli

SMALL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
         "--max-position-embeddings 512 --vocab-size 1000 --micro-batch-size 1 "
         "--global-batch-size 16 --bf16 --lr 1e-4 --train-iters 1 --mock-data").split()


def _plan(capsys, *argv):
    code = plan_cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_text_report_names_every_stage_and_the_step(capsys):
    code, out, _ = _plan(capsys, "--gpu", "a100-80gb", "--num-gpus", "8",
                         "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", *SMALL)
    assert code == 0
    assert "tp=2 pp=2 dp=2" in out and "zero stage 0" in out
    assert len([l for l in out.splitlines() if l.strip().startswith(("0 ", "1 "))]) == 2
    for text in ("peak", "bubble", "tokens/s", "MFU", "fits"):
        assert text in out


def test_json_schema(capsys):
    code, out, _ = _plan(capsys, "--json", "--gpu", "h100-sxm", "--num-gpus", "4",
                         "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                         *SMALL)
    assert code == 0
    doc = json.loads(out)
    assert doc["schema"] == "gigatron-plan-v1" and doc["num_gpus"] == 4
    assert doc["layout"] == {"tp": 1, "pp": 2, "dp": 2, "virtual_chunks": 1, "zero_stage": 1,
                             "optimizer_offload": False, "sequence_parallel": False,
                             "recompute": "none", "micro_batch_size": 1,
                             "num_microbatches": 8, "global_batch_size": 16}
    assert [s["pp_rank"] for s in doc["stages"]] == [0, 1]
    for stage in doc["stages"]:
        b = stage["bytes"]
        assert set(b) == {"params", "grads", "master_params", "optimizer_state",
                          "activations", "transient", "peak"}
        assert b["peak"] == pytest.approx(sum(v for k, v in b.items() if k != "peak"))
    assert doc["stages"][0]["microbatches_in_flight"] == [2]
    assert doc["step"]["bubble"] == pytest.approx(1 / 8)
    assert doc["step"]["step_s"] > doc["step"]["pipeline_s"] > 0
    assert 0 < doc["rates"]["mfu"] < 1 and doc["fits"] is True
    assert doc["gpu"]["key"] == "h100-sxm" and doc["gpu"]["peak_tflops"]["bf16"] == 989.4


def test_hardware_overrides_change_the_prediction(capsys):
    base = json.loads(_plan(capsys, "--json", "--num-gpus", "2", *SMALL)[1])
    slow = json.loads(_plan(capsys, "--json", "--num-gpus", "2", "--peak-tflops", "100",
                            "--gpu-memory-gib", "1", *SMALL)[1])
    assert slow["step"]["step_s"] > base["step"]["step_s"]
    assert slow["gpu"]["memory_bytes"] == 2 ** 30


def test_search_ranks_fitting_layouts_and_gives_each_refusal_its_reason(capsys):
    code, out, _ = _plan(capsys, "--search", "--json", "--gpu", "a100-40gb",
                         "--num-gpus", "4", *SMALL)
    assert code == 0
    doc = json.loads(out)
    steps = [p["step"]["step_s"] for p in doc["ranked"]]
    assert steps == sorted(steps) and len(steps) > 10
    assert all(p["fits"] for p in doc["ranked"])
    reasons = {r["reason"] for r in doc["refused"]}
    assert all(reasons)
    # pp = 2 with ZeRO-3 is refused by the run's own validation, naming the flags
    zero3_pp = [r for r in doc["refused"] if r["layout"]["zero_stage"] == 3 and
                r["layout"]["pp"] > 1]
    assert zero3_pp and all("--zero-stage 3 needs --pipeline-model-parallel-size 1"
                            in r["reason"] for r in zero3_pp)
    # micro-batch 8 x dp 4 does not divide the global batch of 16
    assert any("--global-batch-size 16 is not a multiple" in r for r in reasons)


def test_search_refuses_what_does_not_fit_naming_stage_and_bytes(capsys):
    # every layout of this small model needs 2.79-3.0 GiB on the device (2.44 of it the
    # CUDA context and kernels, allocator.py), so a 2.9 GiB card takes some of them
    code, out, _ = _plan(capsys, "--search", "--gpu", "a100-40gb", "--gpu-memory-gib",
                         "2.9", "--num-gpus", "2", *SMALL)
    assert code == 0
    assert "out of memory: stage 0 needs" in out and "the a100-40gb has 2.9" in out
    assert "layouts fit" in out and not out.startswith("0 layouts fit")


def test_bad_input_is_one_clear_error(capsys):
    code, _, err = _plan(capsys, "--gpu", "tpu-v9", *SMALL)
    assert code == 2 and "--gpu" in err and "h100-sxm" in err
    code, _, err = _plan(capsys, "--num-gpus", "6", "--tensor-model-parallel-size", "4", *SMALL)
    assert code == 2 and "error:" in err and "--tensor-model-parallel-size" in err
    code, _, err = _plan(capsys, "--num-gpus", "0", *SMALL)
    assert code == 2 and "--num-gpus must be > 0" in err
    code, _, err = _plan(capsys, "--num-gpus", "2", "--hidden-sise", "8", *SMALL)
    assert code == 2 and "--hidden-sise" in err
