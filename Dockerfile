# vltrain on a CUDA machine: `docker build -t vltrain .` then
#   docker run --gpus all --ipc=host -v $PWD/runs:/runs vltrain \
#       vltrain train configs/clip.yaml run.out_dir=/runs/clip
# (torchrun -m vltrain train ... for several GPUs; docs/scaling_out.md#containers).
# The base image brings CUDA, cuDNN, NCCL and a matching CUDA build of torch; vltrain never pins
# torch, so pip keeps that build.
ARG BASE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    HF_HOME=/cache/huggingface TORCHINDUCTOR_CACHE_DIR=/cache/inductor
WORKDIR /opt/vltrain
# dependencies first, so a code change rebuilds one small layer
COPY pyproject.toml README.md ./
COPY vltrain ./vltrain
RUN python -m pip install ".[hf,log,stream,tune,scaling,curate,datasets,gguf]" \
    && python -c "import torch, vltrain; print('vltrain', vltrain.__version__, 'torch', torch.__version__)"
WORKDIR /work
CMD ["vltrain", "--help"]
