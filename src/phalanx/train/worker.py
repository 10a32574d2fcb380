"""`python -m phalanx.train.worker`, the worker's former module name (torchrun command lines still use it):
hands over to the entry point `phalanx.worker`, where restart mode lives. Holds no code of its own, and must
not import the entry point except when run: importing `phalanx.train` loads no recovery code."""

if __name__ == "__main__":
    from phalanx.worker import entry

    entry()
