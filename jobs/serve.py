"""Serve a trained policy on its own: python jobs/serve.py model.path=runs/<run>/checkpoint [key=value ...]

The policy endpoint (OpenAI API) and the store API, as during training (configs/train.yaml), until Ctrl-C; every call
is recorded in the run directory's store. The same as `lightning-ray serve [key=value ...]`."""

from lightning_ray.cli.serve import main

if __name__ == "__main__":
    main()
