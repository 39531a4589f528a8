"""The adaptive op set (namespace `adaptex`). Importing this package registers every op."""
from adaptex.graphs.ops import (  # noqa: F401  (registers the ops)
    budgeted_attention, conditional_attention, conditional_ffn, elastic_attention)

OPS = {
    "adaptex::budgeted_attention": budgeted_attention,
    "adaptex::conditional_ffn": conditional_ffn,
    "adaptex::conditional_attention": conditional_attention,
    "adaptex::elastic_attention": elastic_attention,
}
