"""What the Accelerate examples download, made here instead, so that they run offline (gaccum's code).

The examples fetch GLUE MRPC or WikiText with `datasets`, a tokenizer and a pretrained model from
the Hub, and a metric with `evaluate`. The invariance check needs none of what those carry: only
rows the scripts can tokenize-pad and batch as they do, and a model built from a seed. So:

* a word-level tokenizer of 32 ids ([PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, </s> 4, then words);
* sentence pairs with a 0/1 label (MRPC's shape) and lines of text ids (WikiText's), of varied
  lengths, from a seeded generator: the same rows in every run and process;
* tiny BERT and Llama configurations with dropout 0 (dropout draws masks of the batch's shape);
* an accuracy with the `add_batch` / `compute` calls of `evaluate`'s metrics.
"""

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import BertConfig, LlamaConfig, PreTrainedTokenizerFast

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "</s>"]
VOCAB_SIZE = 32


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL + [f"w{i}" for i in range(len(SPECIAL), VOCAB_SIZE)])}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", eos_token="</s>")


def _words(generator, low, high) -> list[int]:
    length = int(torch.randint(low, high + 1, (), generator=generator))
    return torch.randint(len(SPECIAL), VOCAB_SIZE, (length,), generator=generator).tolist()


def sentence_pairs(num_rows: int, seed: int) -> list[dict]:
    """MRPC-shaped rows: [CLS] a [SEP] b [SEP], token types 0 then 1, a 0/1 label."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        first, second = _words(generator, 2, 8), _words(generator, 2, 8)
        rows.append({"input_ids": [2, *first, 3, *second, 3], "token_type_ids": [0] * (len(first) + 2) +
                     [1] * (len(second) + 1), "labels": int(torch.randint(0, 2, (), generator=generator))})
    return rows


def text_lines(num_rows: int, seed: int) -> list[dict]:
    """WikiText-shaped rows: lines of 3 to 14 word ids (no </s>, the examples' padding token)."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": _words(generator, 3, 14)} for _ in range(num_rows)]


def tiny_bert_config() -> BertConfig:
    return BertConfig(vocab_size=VOCAB_SIZE, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, num_labels=2)


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=4)


class Accuracy:
    """evaluate.load("glue", "mrpc")'s calls, accuracy only."""

    def __init__(self):
        self.right, self.seen = 0, 0

    def add_batch(self, predictions, references):
        self.right += int((predictions == references).sum())
        self.seen += len(references)

    def compute(self):
        accuracy = self.right / max(self.seen, 1)
        self.right, self.seen = 0, 0
        return {"accuracy": accuracy}
