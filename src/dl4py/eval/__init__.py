"""Evaluation of trained models (DL4J's ``org.deeplearning4j.eval`` / ``org.nd4j.evaluation``)."""

from dl4py.eval.evaluation import Evaluation
from dl4py.eval.regression import RegressionEvaluation
from dl4py.eval.roc import ROC, ROCMultiClass

__all__ = ["Evaluation", "ROC", "ROCMultiClass", "RegressionEvaluation"]
