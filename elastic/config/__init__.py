"""Configuration: schemas (dataclasses), validation, Hydra composition."""
