"""The adaptive op set (namespace `adaptex`). Importing this package registers every op."""
from graphs.ops import budgeted_attention  # noqa: F401  (registers adaptex::budgeted_attention)

OPS = {
    "adaptex::budgeted_attention": budgeted_attention,
}
