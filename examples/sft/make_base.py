"""The starting point of examples/sft_cpu.sh, built here (nothing is downloaded):

  OUT/base/     a Hugging Face folder: a tiny random LlamaForCausalLM and a byte-level BPE
                tokenizer trained on the example's words, with a ChatML chat template whose
                {% generation %} blocks mark the assistant's tokens;
  OUT/chat.jsonl conversations in Megatron-LM's --sft format: each line holds two
                conversations (each starts at its system turn) asking for the opposite of a
                word; the model has to learn the pairs.

Usage: python examples/sft/make_base.py OUT [--lines N] [--seed S]
"""
import argparse
import json
import os
import random

PAIRS = [("good", "bad"), ("yes", "no"), ("up", "down"), ("hot", "cold"), ("big", "small"),
         ("fast", "slow"), ("day", "night"), ("open", "closed"), ("left", "right"),
         ("old", "new"), ("early", "late"), ("full", "empty"), ("high", "low"),
         ("light", "dark"), ("wet", "dry"), ("soft", "hard")]
OPPOSITE = {**dict(PAIRS), **{b: a for a, b in PAIRS}}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\n' }}{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SYSTEM = "you answer with one word"
QUESTIONS = ("what is the opposite of {}?", "the opposite of {} is?", "{}: opposite?")


def conversation(rng: random.Random) -> list:
    word = rng.choice(sorted(OPPOSITE))
    question = rng.choice(QUESTIONS).format(word)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
            {"role": "assistant", "content": OPPOSITE[word]}]


def write_tokenizer(folder: str) -> "object":
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = sorted(OPPOSITE) + SYSTEM.split() + " ".join(QUESTIONS).split()
    corpus = [" ".join(words)] + [f" {w}" for w in words] + list(QUESTIONS) + [SYSTEM]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus * 8, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, chat_template=CHATML)
    fast.save_pretrained(folder)
    return fast


def write_model(folder: str, tokenizer, seed: int, hidden: int) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--lines", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    args = parser.parse_args()
    base = os.path.join(args.out, "base")
    os.makedirs(base, exist_ok=True)
    tokenizer = write_tokenizer(base)
    write_model(base, tokenizer, args.seed, args.hidden_size)
    rng = random.Random(args.seed)
    with open(os.path.join(args.out, "chat.jsonl"), "w") as f:
        for _ in range(args.lines):
            f.write(json.dumps({"messages": conversation(rng) + conversation(rng)}) + "\n")
    print(f"wrote {base} (tiny random Llama, vocabulary {len(tokenizer)}, ChatML template) "
          f"and {args.lines} lines of conversations in {args.out}/chat.jsonl")


if __name__ == "__main__":
    main()
