"""The adaptive op set (namespace `adaptex`). Importing this package registers every op."""
from graphs.ops import budgeted_attention, conditional_ffn, elastic_attention  # noqa: F401  (registers the ops)

OPS = {
    "adaptex::budgeted_attention": budgeted_attention,
    "adaptex::conditional_ffn": conditional_ffn,
    "adaptex::elastic_attention": elastic_attention,
}
