"""The seed's LeNet on MNIST (DL4J's multi-GPU MNIST tutorial), in dl4py's Python API.

    python examples/lenet_mnist.py [--epochs N] [--backend auto|cpu|gpu]

The same network as examples/lenet_mnist.yaml, built with the DL4J-style builder.
"""

import argparse
import logging

import dl4py
from dl4py import (
    ConvolutionLayer,
    DenseLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
    SubsamplingLayer,
)
from dl4py.train import PerformanceListener, ScoreIterationListener


def lenet_config() -> NetworkConfig:
    return (
        NetworkConfig.builder()
        .seed(123)
        .weight_init("xavier")
        .updater(Nesterovs(learning_rate=0.03, momentum=0.9))
        .l2(0.0005)
        # n_in is never given: it is inferred from the input type, as setInputType does.
        .layer(ConvolutionLayer(n_out=20, kernel_size=(5, 5), stride=(1, 1), activation="identity"))
        .layer(SubsamplingLayer(pooling_type="max", kernel_size=(2, 2), stride=(2, 2)))
        .layer(ConvolutionLayer(n_out=50, kernel_size=(5, 5), stride=(1, 1), activation="identity"))
        .layer(SubsamplingLayer(pooling_type="max", kernel_size=(2, 2), stride=(2, 2)))
        .layer(DenseLayer(n_out=500, activation="relu"))
        .layer(OutputLayer(n_out=10, activation="softmax", loss="negativeloglikelihood"))
        .input_type(InputType.convolutional_flat(28, 28, 1))
        .build()
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--backend", default="auto", choices=["auto", "cpu", "gpu"])
    parser.add_argument("--save", default="lenet_mnist.dl4py")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    batch_size = 128
    mnist_train = MnistDataSetIterator(batch_size, train=True, seed=12345)
    mnist_test = MnistDataSetIterator(batch_size, train=False, seed=12345)

    model = MultiLayerNetwork(lenet_config(), backend=args.backend).init()
    print(model.summary())
    model.fit(mnist_train, epochs=args.epochs,
              listeners=[ScoreIterationListener(100), PerformanceListener(100)])
    print(model.evaluate(mnist_test).stats())
    model.save(args.save)
    restored = dl4py.load(args.save)
    print(f"saved to {args.save}; reloaded model accuracy "
          f"{restored.evaluate(mnist_test).accuracy():.4f}")


if __name__ == "__main__":
    main()
