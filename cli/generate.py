"""Generate text from a checkpoint: KV cache, greedy or sampled decoding, tensor parallel."""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

if TYPE_CHECKING:
    from gigatron.data.tokenizer import Tokenizer

PROG = "gigatron generate"
# settings of the training run a generation does not take over (besides its outputs)
# (generation runs without context parallelism: the KV cache holds the whole sequence)
OVERRIDES = {"sequence_parallel": False, "pipeline_model_parallel_size": 1,
             "context_parallel_size": 1,
             "global_batch_size": None, "rampup_batch_size": None, "data_path": None,
             "train_data_path": None, "valid_data_path": None, "test_data_path": None,
             "mock_data": True}


def build_parser() -> argparse.ArgumentParser:
    """The command's own flags; every other flag is Megatron's and overrides the
    checkpoint's (e.g. --tensor-model-parallel-size, --tokenizer-model)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Megatron flags (docs/FLAGS.md) override the checkpoint's; the model flags "
               "come from its metadata.json. Launch tp ranks with torchrun (or gigatron "
               "launch) to generate tensor-parallel: --tensor-model-parallel-size defaults "
               "to the world size. Sampling semantics: docs/GENERATION.md.")
    parser.add_argument("--load", required=True, help="checkpoint folder (a run's --save)")
    parser.add_argument("--prompt", action="append", default=[],
                        help="a prompt (repeat for a batch; NullTokenizer: token ids)")
    parser.add_argument("--prompt-file", default=None,
                        help="a file with one prompt per line (added to --prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate per prompt at most")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (argmax); > 0: sample from softmax(logits / T)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of tokens whose probability "
                             "reaches p (1.0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    parser.add_argument("--stop-token", type=int, action="append", default=None,
                        help="a token id that ends a prompt's generation (repeatable; "
                             "default: the tokenizer's end-of-document id)")
    parser.add_argument("--ignore-eod", action="store_true",
                        help="do not stop at the end-of-document token")
    parser.add_argument("--no-stream", action="store_true",
                        help="print when done instead of token by token (a batch of "
                             "several prompts always prints when done)")
    parser.add_argument("--output", default=None,
                        help="also write one JSON line per prompt: prompt, tokens, text")
    return parser


def _prompts(args: argparse.Namespace) -> List[str]:
    texts = list(args.prompt)
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        raise ValueError("no prompt: give --prompt TEXT (repeatable) or --prompt-file FILE")
    return texts


def _stop_tokens(args: argparse.Namespace, tokenizer: "Tokenizer") -> List[int]:
    if args.stop_token is not None:
        return list(args.stop_token)
    return [] if args.ignore_eod else [tokenizer.eod]


def continuation(tokenizer: "Tokenizer", prompt: List[int], tokens: List[int]) -> str:
    """The text the generated tokens add to the prompt's (detokenized together, so a
    tokenizer's spacing and merges between the two come out right)."""
    before, after = tokenizer.detokenize(prompt), tokenizer.detokenize(prompt + tokens)
    return after[len(before):] if after.startswith(before) else tokenizer.detokenize(tokens)


def _streamer(tokenizer: "Tokenizer", prompt: List[int],
              out) -> Callable[[List[Optional[int]]], None]:
    """Prints a single prompt, then its new text as the tokens come."""
    tokens: List[int] = []
    shown = [""]
    out.write(tokenizer.detokenize(prompt))

    def on_step(news: List[Optional[int]]) -> None:
        if news[0] is None:
            return
        tokens.append(news[0])
        text = continuation(tokenizer, prompt, tokens)
        if text.startswith(shown[0]):
            out.write(text[len(shown[0]):])
            out.flush()
            shown[0] = text

    return on_step


def _run(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from gigatron.models.generation import SamplingParams, generate
    from gigatron.parallel.world import init_distributed, read_launch_env
    from gigatron.training.config.arguments import build_run
    from gigatron.training.run.from_checkpoint import inference_settings, load_model

    problems = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed).problems()
    if args.max_new_tokens < 0:
        problems.append(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if problems:  # the API's words, the flags' names
        raise ValueError("\n".join(p.replace("top_k", "--top-k").replace("top_p", "--top-p")
                                   .replace("temperature", "--temperature") for p in problems))
    launch = read_launch_env()
    settings = inference_settings(rest, args.load, PROG, {
        **OVERRIDES, "tensor_model_parallel_size": launch.world_size})
    if settings.parallel.pp != 1:
        raise ValueError("gigatron generate runs with --pipeline-model-parallel-size 1 "
                         "(pipeline-parallel generation is not supported): launch tp ranks")
    if settings.parallel.context_parallel_size != 1:
        raise ValueError("gigatron generate runs with --context-parallel-size 1 (the KV cache "
                         "holds the whole sequence): drop --context-parallel-size")
    run, tokenizer = build_run(settings, launch.world_size)
    assert tokenizer is not None
    if run.parallel.dp != 1:
        raise ValueError(f"gigatron generate runs on tensor-parallel ranks only: launch "
                         f"--tensor-model-parallel-size ({run.parallel.tp}) ranks, not "
                         f"{launch.world_size}")
    texts = _prompts(args)
    prompts = [tokenizer.tokenize(t) for t in texts]
    launch, device = init_distributed(run.parallel.distributed_timeout_minutes)
    _, chunks = load_model(run, launch.rank, device)
    printing = launch.rank == 0
    stream = printing and not args.no_stream and len(prompts) == 1
    result = generate(chunks[0], prompts, args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      stop_tokens=_stop_tokens(args, tokenizer),
                      on_step=_streamer(tokenizer, prompts[0], sys.stdout) if stream else None)
    if not printing:
        return 0
    if stream:
        sys.stdout.write("\n")
    lines = []
    for text, prompt, tokens in zip(texts, prompts, result.tokens):
        if not stream:
            print(tokenizer.detokenize(prompt + tokens) + "\n", flush=True)
        lines.append(json.dumps({"prompt": text, "tokens": tokens,
                                 "text": continuation(tokenizer, prompt, tokens)}))
    if args.output is not None:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron generate --load CKPT --prompt TEXT [sampling flags] [Megatron flags]`."""
    args, rest = build_parser().parse_known_args(None if argv is None else list(argv))
    return run_command(PROG, lambda: _run(args, rest))


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run an inference command's body: a ValueError is one error line (from rank 0) and
    exit status 2; the process group is left at the end."""
    import torch.distributed as dist
    from gigatron.parallel.world import read_launch_env

    try:
        return body()
    except ValueError as err:
        if read_launch_env().rank == 0:  # every rank finds the same error
            print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
