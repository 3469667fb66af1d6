"""Moving a DL4J model to dl4py, end to end: import DL4J's ModelSerializer zip, evaluate it,
go on training it, serve it over HTTP, export it to ONNX, and write it back for DL4J.

    python examples/dl4j_migration.py MODEL.zip TRAIN.csv TEST.csv [--classes 2] [--out DIR]

The CSV files hold the label in the first column (as DL4J's moon data: ``label,x,y``). With
DL4J's integration-test files beside this repository (``MLPMoon``, the moon data) it runs as
``python examples/dl4j_migration.py`` without arguments. Each step prints one line.
"""

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

import dl4py
from dl4py import CsvDataSetIterator
from dl4py.export import export
from dl4py.serve import PredictionServer

DL4J_FILES = Path(__file__).resolve().parents[1].parent / "shared" / "dl4j-models" / "dl4j-integration-tests"
MOON = (DL4J_FILES / "MLPMoon" / "Model_RANDOM_INIT_UNTRAINED.zip", DL4J_FILES / "data" / "moon_data_train.csv",
        DL4J_FILES / "data" / "moon_data_eval.csv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="MODEL.zip TRAIN.csv TEST.csv (default: DL4J's MLPMoon)")
    parser.add_argument("--classes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="where the written files go (default: a temporary folder)")
    args = parser.parse_args()
    model_zip, train_csv, test_csv = args.files or MOON
    out = args.out or Path(tempfile.mkdtemp(prefix="dl4j-migration-"))
    out.mkdir(parents=True, exist_ok=True)

    # 1. Import: DL4J's configuration, parameters (exact), updater state and normalizer.
    net = dl4py.import_dl4j(model_zip)
    print(f"imported {model_zip.name}: {len(net.config.layers)} layers, "
          f"{sum(p.numel() for p in net.module.parameters())} parameters")

    # 2. Evaluate, DL4J-style.
    def test_data():
        return CsvDataSetIterator(test_csv, batch_size=100, label_index=0, num_classes=args.classes, shuffle=False)

    before = net.evaluate(test_data()).accuracy()
    print(f"accuracy as imported: {before:.4f}")

    # 3. Go on training where DL4J stopped (its updater state and counters came with the file).
    train = CsvDataSetIterator(train_csv, batch_size=50, label_index=0, num_classes=args.classes, seed=12345)
    net.fit(train, epochs=args.epochs, verbose=0)
    after = net.evaluate(test_data()).accuracy()
    print(f"accuracy after {args.epochs} epoch(s) in dl4py: {after:.4f}")
    net.save(out / "model.dl4py")

    # 4. Serve it (what `dl4py serve model.dl4py` does), and ask for one prediction.
    features = next(iter(test_data())).features[:3].numpy()
    with_server = PredictionServer(net, port=0).start()
    try:
        body = json.dumps({"features": features.tolist()}).encode()
        request = urllib.request.Request(f"http://{with_server.host}:{with_server.port}/predict", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            served = np.array(json.loads(response.read())["probabilities"])
    finally:
        with_server.stop(timeout=60)
    local = net.output(features).numpy()
    print(f"served 3 predictions, largest difference from net.output: {np.abs(served - local).max():.2e}")

    # 5. Export to ONNX (`dl4py export model.dl4py --format onnx`) and run it in ONNX Runtime.
    onnx_path = export(net, out / "model.onnx")
    try:
        import onnxruntime  # optional: onnxruntime (extra onnx)
    except ImportError:
        print(f"exported {onnx_path.name} (onnxruntime is not installed: not run)")
    else:
        session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        ran = session.run(None, {session.get_inputs()[0].name: features})[0]
        print(f"exported {onnx_path.name}; ONNX Runtime's largest difference from net.output: "
              f"{np.abs(ran - local).max():.2e}")

    # 6. Write it back as a DL4J zip, for a Java serving stack.
    net.save_dl4j(out / "model.zip")
    again = dl4py.import_dl4j(out / "model.zip")
    same = np.array_equal(again.output(features).numpy(), local)
    print(f"wrote {out / 'model.zip'}; imported again, the same outputs: {same}")


if __name__ == "__main__":
    main()
