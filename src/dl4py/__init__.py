"""dl4py: Deeplearning4j's GPU training system for Python, built on PyTorch.

Public names are re-exported here; import from ``dl4py`` or its subpackages
(``dl4py.config``, ``dl4py.data``, ``dl4py.nn``, ``dl4py.train``, ``dl4py.eval``,
``dl4py.backend``), nothing deeper. Importing dl4py touches no device.

The names load when first used (PEP 562's module ``__getattr__``): ``import dl4py`` and the
``dl4py`` command's start (``--help``, ``--version``) do not import PyTorch, which is most of
the time a command takes to start; ``from dl4py import MultiLayerNetwork`` imports what it needs.
"""

from importlib import import_module

from dl4py.version import __version__  # noqa: F401  (dl4py.__version__)

# Where each public name lives: its module is imported the first time the name is asked for.
_EXPORTS = {
    "dl4py.backend": (
        "Environment", "environment", "get_default_dtype", "resolve_backend", "set_backend",
        "set_default_dtype",
    ),
    "dl4py.config": (
        "ActivationLayer", "Adam", "AdamW", "BatchNormalization", "ConvolutionLayer", "DenseLayer",
        "DropoutLayer", "FrozenLayer", "GlobalPoolingLayer", "InputType", "Nesterovs", "NetworkConfig",
        "OutputLayer", "RmsProp", "RunConfig", "Sgd", "SubsamplingLayer",
    ),
    "dl4py.data": (
        "ArrayDataSetIterator", "CsvDataSetIterator", "DataSet", "DataSetIterator", "DeviceDataSetIterator",
        "ImageFolderIterator", "ImagePreProcessingScaler", "MnistDataSetIterator", "NormalizerMinMaxScaler",
        "NormalizerStandardize", "TableDirectoryIterator",
    ),
    "dl4py.config.recurrent": (
        "EmbeddingLayer", "EmbeddingSequenceLayer", "GRU", "LastTimeStep", "LSTM", "RnnOutputLayer",
    ),
    "dl4py.config.recurrent_extra": ("Bidirectional", "GravesBidirectionalLSTM", "GravesLSTM", "SimpleRnn"),
    "dl4py.config.layers_extra": (
        "Convolution1DLayer", "Deconvolution2D", "LayerNormalization", "SelfAttentionLayer",
        "Subsampling1DLayer", "Upsampling2D", "ZeroPaddingLayer",
    ),
    "dl4py.config.layers_conv": (
        "CnnLossLayer", "Cropping1D", "Cropping2D", "DepthwiseConvolution2D", "SeparableConvolution2D",
        "ZeroPadding1DLayer",
    ),
    "dl4py.data.sequences": ("SequenceDataSetIterator",),
    "dl4py.errors": ("BackendError", "ConfigError", "DataError", "DL4PyError", "InferenceError", "TrainingError"),
    "dl4py.eval": ("Evaluation", "RegressionEvaluation", "ROC", "ROCMultiClass"),
    "dl4py.nn": (
        "ComputationGraph", "FineTuneConfiguration", "load", "MultiLayerNetwork", "TorchModel",
        "TransferLearning",
    ),
    "dl4py.dl4j": ("import_dl4j",),
    "dl4py.config.graph": (
        "ComputationGraphConfiguration", "ElementWiseVertex", "GraphConfig", "MergeVertex",
        "PreprocessorVertex", "SubsetVertex",
    ),
    "dl4py.train": ("TrainingInterrupted",),
    "dl4py.train.keras_callbacks": ("EarlyStopping", "ModelCheckpoint"),
    "dl4py.inference": ("ParallelInference",),
    "dl4py.monitor.server": ("UIServer",),  # DL4J's UIServer.getInstance(): UIServer.get_instance()
    "dl4py.monitor.mlflow_model": ("log_mlflow_model", "save_mlflow_model"),
    "dl4py.monitor.wandb_storage": ("WandbStatsStorage",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        try:  # a subpackage not imported yet: dl4py.dl4j, dl4py.export, ...
            return import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the subpackage exists and failed to import: that error, not this one
            raise AttributeError(f"module 'dl4py' has no attribute {name!r}") from None
    value = getattr(import_module(module), name)
    globals()[name] = value  # asked once: the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
