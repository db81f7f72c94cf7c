"""A small Hugging Face tokenizer with a chat template, built here (nothing downloaded), and
conversations for the --sft tests and examples/sft_cpu.sh's test."""
import json
import os

WORDS = ("the a cat dog sat on mat hello how are you I am fine what is your name my bot "
         "user system assistant answer question yes no it was good bad why because").split()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with the assistant's reply and end-of-turn inside {% generation %}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\n' }}{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# the same text without generation blocks
CHATML_PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def make_chat_tokenizer(folder, template=CHATML, vocab_size=300):
    """Save a byte-level BPE tokenizer (eos <|im_end|>, pad <|endoftext|>) with `template`
    (None: no chat template) in `folder`; returns the folder."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    kwargs = {"chat_template": template} if template else {}
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", **kwargs)
    fast.save_pretrained(str(folder))
    return str(folder)


def conversation(i, turns=1):
    """A system prompt and `turns` user/assistant exchanges, varied by i."""
    w = WORDS
    out = [{"role": "system", "content": f"you are {w[i % 7]} bot"}]
    for t in range(turns):
        k = i + 3 * t
        out.append({"role": "user", "content": f"{w[k % 11]} is {w[(k + 2) % 13]} {w[k % 5]}"})
        out.append({"role": "assistant",
                    "content": f"{w[(k + 1) % 11]} {w[(k + 4) % 13]} was {w[(k * 7) % 17]}"})
    return out


def write_jsonl(path, lines):
    """Each entry of `lines` is a list of messages (several conversations back to back)."""
    with open(path, "w") as f:
        for messages in lines:
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def hf_folder_exists(folder):
    return os.path.isfile(os.path.join(folder, "tokenizer.json"))
