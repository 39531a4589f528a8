"""A user's data: JSONL classification files and text corpora, streamed (never loaded whole), split
deterministically, tokenised by a tokenizer.json or characters; errors name the file and line."""
from adaptex.graphs.data.classification import JsonlClassification  # noqa: F401
from adaptex.graphs.data.corpus import TextCorpus, TextFiles, TextPassages, text_tokenizer  # noqa: F401
from adaptex.graphs.data.lines import HOLDOUT, data_files, held_out  # noqa: F401
from adaptex.graphs.tokenizers import CharTokenizer, JsonTokenizer, from_spec  # noqa: F401
