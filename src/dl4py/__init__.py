"""dl4py: Deeplearning4j's GPU training system for Python, built on PyTorch.

Public names are re-exported here; import from ``dl4py`` or its subpackages
(``dl4py.config``, ``dl4py.data``, ``dl4py.nn``, ``dl4py.train``, ``dl4py.eval``,
``dl4py.backend``), nothing deeper. Importing dl4py touches no device.
"""

from dl4py.version import __version__  # noqa: F401  (dl4py.__version__)

from dl4py.backend import (
    Environment,
    environment,
    get_default_dtype,
    resolve_backend,
    set_backend,
    set_default_dtype,
)
from dl4py.config import (
    ActivationLayer,
    Adam,
    AdamW,
    BatchNormalization,
    ConvolutionLayer,
    DenseLayer,
    DropoutLayer,
    FrozenLayer,
    GlobalPoolingLayer,
    InputType,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
    RmsProp,
    RunConfig,
    Sgd,
    SubsamplingLayer,
)
from dl4py.data import (
    ArrayDataSetIterator,
    CsvDataSetIterator,
    DataSet,
    DataSetIterator,
    DeviceDataSetIterator,
    ImageFolderIterator,
    ImagePreProcessingScaler,
    MnistDataSetIterator,
    NormalizerMinMaxScaler,
    NormalizerStandardize,
    TableDirectoryIterator,
)
from dl4py.config.recurrent import (
    GRU,
    LSTM,
    EmbeddingLayer,
    EmbeddingSequenceLayer,
    LastTimeStep,
    RnnOutputLayer,
)
from dl4py.config.recurrent_extra import Bidirectional, GravesBidirectionalLSTM, GravesLSTM, SimpleRnn
from dl4py.config.layers_extra import (
    Convolution1DLayer,
    Deconvolution2D,
    LayerNormalization,
    SelfAttentionLayer,
    Subsampling1DLayer,
    Upsampling2D,
    ZeroPaddingLayer,
)
from dl4py.config.layers_conv import (
    CnnLossLayer,
    Cropping1D,
    Cropping2D,
    DepthwiseConvolution2D,
    SeparableConvolution2D,
    ZeroPadding1DLayer,
)
from dl4py.data.sequences import SequenceDataSetIterator
from dl4py.errors import BackendError, ConfigError, DataError, DL4PyError, InferenceError, TrainingError
from dl4py.eval import ROC, Evaluation, RegressionEvaluation, ROCMultiClass
from dl4py.nn import ComputationGraph, FineTuneConfiguration, MultiLayerNetwork, TorchModel, TransferLearning, load
from dl4py.dl4j import import_dl4j
from dl4py.config.graph import (
    ComputationGraphConfiguration,
    ElementWiseVertex,
    GraphConfig,
    MergeVertex,
    PreprocessorVertex,
    SubsetVertex,
)
from dl4py.train import TrainingInterrupted
from dl4py.train.keras_callbacks import EarlyStopping, ModelCheckpoint
from dl4py.inference import ParallelInference

__all__ = [
    "ComputationGraph", "ComputationGraphConfiguration", "ElementWiseVertex", "GraphConfig", "MergeVertex",
    "PreprocessorVertex", "SubsetVertex",
    "ActivationLayer", "Adam", "AdamW", "ArrayDataSetIterator", "BackendError",
    "BatchNormalization", "ConfigError", "ConvolutionLayer", "CsvDataSetIterator", "DataError",
    "DataSet", "DataSetIterator", "DenseLayer", "DeviceDataSetIterator", "DL4PyError", "DropoutLayer", "Environment",
    "Evaluation", "FineTuneConfiguration", "FrozenLayer", "GlobalPoolingLayer", "ImageFolderIterator", "ImagePreProcessingScaler", "InputType", "MnistDataSetIterator", "MultiLayerNetwork",
    "RegressionEvaluation", "ROC", "ROCMultiClass",
    "Nesterovs", "NetworkConfig", "NormalizerMinMaxScaler", "NormalizerStandardize", "OutputLayer", "RmsProp", "RunConfig", "Sgd", "SubsamplingLayer",
    "TableDirectoryIterator", "TorchModel", "TrainingError", "TransferLearning", "TrainingInterrupted", "environment", "get_default_dtype", "load",
    "resolve_backend", "set_backend", "set_default_dtype",
    "EmbeddingLayer", "EmbeddingSequenceLayer", "GRU", "LastTimeStep", "LSTM", "RnnOutputLayer",
    "Bidirectional", "GravesBidirectionalLSTM", "GravesLSTM", "SimpleRnn",
    "SequenceDataSetIterator",
    "Convolution1DLayer", "Deconvolution2D", "LayerNormalization", "SelfAttentionLayer",
    "Subsampling1DLayer", "Upsampling2D", "ZeroPaddingLayer",
    "CnnLossLayer", "Cropping1D", "Cropping2D", "DepthwiseConvolution2D", "SeparableConvolution2D",
    "ZeroPadding1DLayer",
    "InferenceError", "ParallelInference",
    "EarlyStopping", "ModelCheckpoint",
    "import_dl4j",
]
