"""The control plane: resident models, the engine hub (safe points, switching), cache control."""
