"""Evaluation of trained classifiers (DL4J's ``org.deeplearning4j.eval``)."""

from dl4py.eval.evaluation import Evaluation

__all__ = ["Evaluation"]
