"""An LSTM sequence classifier on variable-length sequences (DL4J's UCI sequence example,
on data this script makes), in seconds on a CPU.

    python examples/lstm_sequence.py [--epochs N]

Each sequence has 3 to 20 steps of 2 noisy values; its class is the sign of its first
value, so the network must carry it to the sequence's last real step. Sequences are padded
per batch and masked (SequenceDataSetIterator); LastTimeStep reads each one's last real step.
"""

import argparse

import numpy as np

from dl4py import (
    LSTM,
    Adam,
    InputType,
    LastTimeStep,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    SequenceDataSetIterator,
)


def sequences(n: int, seed: int):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(rng.integers(3, 21), 2)).astype(np.float32) for _ in range(n)]
    return xs, [int(x[0, 0] > 0) for x in xs]


def lstm_config() -> NetworkConfig:
    return (
        NetworkConfig.builder()
        .seed(123)
        .updater(Adam(learning_rate=0.02))
        .layer(LastTimeStep(LSTM(n_out=32)))  # [batch, time, 2] -> [batch, 32]
        .layer(OutputLayer(n_out=2, loss="mcxent"))
        .input_type(InputType.recurrent(2))  # 2 values per step, any number of steps
        .build()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()

    train = SequenceDataSetIterator(*sequences(800, seed=1), batch_size=32, shuffle=True)
    test = SequenceDataSetIterator(*sequences(500, seed=2), batch_size=250)
    net = MultiLayerNetwork(lstm_config()).init()
    print(net.summary())
    net.fit(train, epochs=args.epochs, verbose=2)
    print(net.evaluate(test).stats())


if __name__ == "__main__":
    main()
