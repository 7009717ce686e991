from .model_config import ModelConfig, model_config
from .qtypes import SUPPORTED, SUPPORTED_NAMES, block_geometry, row_bytes
from .reader import GgufFile, TensorInfo

__all__ = ["GgufFile", "TensorInfo", "ModelConfig", "model_config", "SUPPORTED", "SUPPORTED_NAMES",
           "block_geometry", "row_bytes"]
