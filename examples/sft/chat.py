"""The last step of examples/sft_cpu.sh: transformers loads the exported folder (model and
tokenizer with its chat template) and answers every word's question greedily; prints the
answers and how many are right, and fails below --min-right (a fraction).

Usage: python examples/sft/chat.py HF_DIR [--min-right 0.5]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_base import OPPOSITE, QUESTIONS, SYSTEM  # noqa: E402


def answers(folder: str):
    """(word, expected, the model's answer) for every word, asked the first question form."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    out = []
    for word in sorted(OPPOSITE):
        chat = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTIONS[0].format(word)}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        tokens = model.generate(**prompt, max_new_tokens=8, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
        reply = tokenizer.decode(tokens[0, prompt["input_ids"].shape[1]:],
                                 skip_special_tokens=True).strip()
        out.append((word, OPPOSITE[word], reply))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--min-right", type=float, default=0.5)
    args = parser.parse_args()
    results = answers(args.folder)
    for word, want, got in results[:6]:
        print(f"  user: {QUESTIONS[0].format(word)!r} -> assistant: {got!r} (want {want!r})")
    right = sum(got == want for _, want, got in results)
    print(f"transformers, chat template of {args.folder}: {right} of {len(results)} answers "
          f"right")
    if right < args.min_right * len(results):
        sys.exit(f"fewer than {args.min_right:.0%} right: the fine-tuning did not take")


if __name__ == "__main__":
    main()
