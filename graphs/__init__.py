"""What an adaptive model is: models, routers, losses, training, and the custom ops."""
import adaptex.graphs.ops  # noqa: F401  (registers the adaptex:: custom ops with torch)
