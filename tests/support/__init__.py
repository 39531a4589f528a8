

def set_bodies(mp, name: str, value) -> None:
    """Set a tuning constant in every ONNX body module that reads it."""
    import sys

    for mod in [m for k, m in sys.modules.items() if k.startswith("adaptex.exporter.targets.onnx.bodies")]:
        if hasattr(mod, name):
            mp.setattr(mod, name, value)
