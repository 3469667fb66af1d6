"""Answering requests with a trained model: ``ParallelInference`` (DL4J's), over replicas."""

from dl4py.inference.parallel_inference import MODES, ParallelInference

__all__ = ["MODES", "ParallelInference"]
