"""What Hugging Face fills for a DeepSpeed config's "auto" values, run by the real libraries.

    python hf_auto_fill_script.py transformers < cases.json   # a JSON list of filled configs
    python hf_auto_fill_script.py accelerate < case.json      # one filled config

A case is {"config": path, "args": {TrainingArguments attribute: value}, "hidden_size": h,
"world_size": n}. `transformers` runs the Trainer's HfTrainerDeepSpeedConfig
(trainer_config_process, then trainer_config_finalize with args.max_steps training steps);
`accelerate` runs Accelerator.prepare on one CPU process (it calls deepspeed.initialize)
with the same knowledge as accelerate's own inputs: a DataLoader of
per_device_train_batch_size, DummyOptim(learning_rate, weight_decay) and
DummyScheduler(max_steps, warmup_steps). Used by tests/test_deepspeed_auto.py (which skips
without transformers, accelerate and deepspeed).
"""
import json
import os
import sys
import types

import torch


class HiddenSizeModel(torch.nn.Module):
    """A model with a Hugging Face style config.hidden_size."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=hidden)
        self.linear = torch.nn.Linear(hidden, hidden)


def trainer_fill(case: dict) -> dict:
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    with open(case["config"]) as f:
        config = json.load(f)
    args = types.SimpleNamespace(world_size=case["world_size"], save_on_each_node=False,
                                 **case["args"])
    args.get_warmup_steps = types.MethodType(TrainingArguments.get_warmup_steps, args)
    hf = HfTrainerDeepSpeedConfig(config)
    hf.trainer_config_process(args)
    model = HiddenSizeModel(case["hidden_size"])
    hf.trainer_config_finalize(args, model, args.max_steps)
    return hf.config


def accelerate_fill(case: dict) -> dict:
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29593"), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    with open(case["config"]) as f:
        config = json.load(f)
    args = case["args"]
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = HiddenSizeModel(case["hidden_size"])
    loader = torch.utils.data.DataLoader(torch.zeros(64, case["hidden_size"]),
                                         batch_size=args["per_device_train_batch_size"])
    optimizer = DummyOptim(model.parameters(), lr=args["learning_rate"],
                           weight_decay=args["weight_decay"])
    scheduler = DummyScheduler(optimizer, total_num_steps=args["max_steps"],
                               warmup_num_steps=args["warmup_steps"])
    accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator.deepspeed_plugin.deepspeed_config


def main() -> None:
    mode, cases = sys.argv[1], json.load(sys.stdin)
    out = [trainer_fill(c) for c in cases] if mode == "transformers" else accelerate_fill(cases)
    print("FILLED " + json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main()
