"""Serve a trained policy on its own: python jobs/serve.py model.path=runs/<run>/checkpoint [key=value ...]

The policy endpoint (OpenAI API) and the store API, as during training (configs/train.yaml), until Ctrl-C; every call
is recorded in the run directory's store. The same as `lightning-ray serve [key=value ...]`. `app` is the same
policy as a Serve application builder, for a Serve config (k8s/rayservice.yaml)."""

from lightning_ray.cli.serve import app, main  # noqa: F401  (app: Serve's import_path jobs.serve:app)

if __name__ == "__main__":
    main()
