"""Network and run configuration as plain, round-trippable data."""

from dl4py.config.input_type import Convolutional, ConvolutionalFlat, FeedForward, InputType, Recurrent
from dl4py.config.layers import (
    ActivationLayer,
    BatchNormalization,
    ConvolutionLayer,
    DenseLayer,
    DropoutLayer,
    GlobalPoolingLayer,
    Layer,
    OutputLayer,
    SubsamplingLayer,
)
from dl4py.config.frozen import FrozenLayer
from dl4py.config.layers_conv import (
    CnnLossLayer,
    Cropping1D,
    Cropping2D,
    DepthwiseConvolution2D,
    SeparableConvolution2D,
    ZeroPadding1DLayer,
)
from dl4py.config.layers_extra import (
    Convolution1DLayer,
    Deconvolution2D,
    LayerNormalization,
    SelfAttentionLayer,
    Subsampling1DLayer,
    Upsampling2D,
    ZeroPaddingLayer,
)
from dl4py.config.network import NetworkConfig
from dl4py.config.graph import (
    ComputationGraphConfiguration,
    ElementWiseVertex,
    GraphConfig,
    GraphNode,
    GraphVertex,
    MergeVertex,
    PreprocessorVertex,
    SubsetVertex,
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
from dl4py.config.run import DataConfig, EnvironmentConfig, LoggingConfig, RunConfig, TrainingConfig
from dl4py.config.schedules import (
    ExponentialSchedule,
    OneCycleSchedule,
    PolySchedule,
    Schedule,
    StepSchedule,
)
from dl4py.config.updaters import Adam, AdamW, Nesterovs, RmsProp, Sgd, Updater

__all__ = [
    "ActivationLayer", "Adam", "AdamW", "BatchNormalization", "Convolutional", "ConvolutionalFlat",
    "ConvolutionLayer", "DataConfig", "DenseLayer", "DropoutLayer", "EnvironmentConfig",
    "ExponentialSchedule", "FeedForward", "FrozenLayer", "GlobalPoolingLayer", "InputType", "Layer", "LoggingConfig", "Nesterovs",
    "NetworkConfig", "OneCycleSchedule", "OutputLayer", "PolySchedule", "RmsProp", "RunConfig",
    "Schedule", "Sgd", "StepSchedule", "SubsamplingLayer", "TrainingConfig", "Updater",
    "GRU", "LSTM", "EmbeddingLayer", "EmbeddingSequenceLayer", "LastTimeStep", "Recurrent",
    "RnnOutputLayer",
    "Bidirectional", "GravesBidirectionalLSTM", "GravesLSTM", "SimpleRnn",
    "Convolution1DLayer", "Deconvolution2D", "LayerNormalization", "SelfAttentionLayer",
    "Subsampling1DLayer", "Upsampling2D", "ZeroPaddingLayer",
    "CnnLossLayer", "Cropping1D", "Cropping2D", "DepthwiseConvolution2D", "SeparableConvolution2D",
    "ZeroPadding1DLayer",
    "ComputationGraphConfiguration", "ElementWiseVertex", "GraphConfig", "GraphNode", "GraphVertex",
    "MergeVertex", "PreprocessorVertex", "SubsetVertex",
]
