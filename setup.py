"""megagenome: pretrain genomic (DNA) language models on the DeepSpeed engine.

Versions are pinned to the set the test suite runs against (see .ci/run). On a machine without a
GPU, torch==2.13.0 installs the CPU build; on a CUDA machine the same pin installs the CUDA build.
"""

from setuptools import find_packages, setup

setup(
    name="megagenome",
    version="0.1.0",
    description="DeepSpeed-based, Megatron-style pretraining of genomic (DNA) language models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megagenome", "megagenome.*"]),
    # DeepSpeed's config-section fields, copied for checks that import no deepspeed (megagenome/engine/ds_schema.py).
    package_data={"megagenome": ["engine/ds_sections.json", "model/caduceus/csrc/*.cpp", "model/caduceus/csrc/*.h"]},
    install_requires=[
        "torch==2.13.0",
        "deepspeed==0.19.8",
        "numpy==2.2.6",
        "pyfaidx==0.9.2.2",
        "biopython==1.88",  # pyfaidx reads BGZF through Bio.bgzf
        "jsonargparse[signatures]==4.53.0",
        "PyYAML==6.0.4",
        "tqdm==4.70.1",
        "pysam==0.24.1",  # VCF reading and writing (htslib): data/variants.py, data/vcf_scores.py
        "safetensors==0.8.0",  # `megagenome export`: model.safetensors, the format Hugging Face loads; `embed`'s output
        "tensorboard==2.21.0",  # event files beside metrics.jsonl (torch.utils.tensorboard writes through it)
        "matplotlib==3.10.9",  # `megagenome report` draws its PNGs
        # Supervised variant-effect prediction (score-variants --supervised: logistic regression / gradient boosting,
        # grouped cross-validation) and the task metrics of `finetune` (MCC, AUROC; Spearman through its scipy).
        "scikit-learn==1.9.1",
        # Caduceus' selective scan on CPU (model/caduceus/scan.py): mamba.py's parallel (Blelloch) scan in plain
        # torch, which needs nothing but torch; mamba-ssm's CUDA kernel is used instead when installed on a GPU.
        "mambapy==1.2.0",
    ],
    extras_require={
        # flash-attn compiles against the local CUDA toolkit; install it on GPU machines only.
        "gpu": ["flash-attn==2.8.3.post2"],
        # Everything a test imports, so that `pytest` runs every test on CPU (tests/test_readme.py checks it):
        # transformers (exports loaded with AutoModelForCausalLM/AutoTokenizer, the docs' generate example, the
        # peers' Llama), wandb (--log.wandb's offline files) and peft (finetune --model.lora). Only bitsandbytes'
        # CUDA client is left to GPUs.
        # mkdocs and mkdocs-material as in the docs extra: tests/test_docs_site.py builds the site with --strict.
        # einops: what stripedhyena 0.2.2 (tests/test_hyena_oracle.py's oracle) imports; the README's test command
        # installs stripedhyena itself with --no-deps, since it declares flash-attn, which needs CUDA to build.
        "dev": [
            "pytest==9.2.0",
            "einops==0.8.2",
            "ruff==0.17.6",
            "transformers==5.24.0",
            "wandb==0.31.0",
            "mkdocs==1.6.1",
            "mkdocs-material==9.8.1",
            "peft==0.21.2",
            "torchao==0.18.0",  # the int8 extra: INT8 export and the 8-bit AdamW on CPU
            # The GPN oracle (tests/test_gpn.py): the gpn package's own model, built from its config, must give our
            # gpn family's logits from the same weights. Its only release for Python < 3.13 is this pre-release.
            "gpn==0.9.0a1",
        ],
        # `megagenome finetune --model.lora true`: Hugging Face's LoRA adapters on any torch module, merged back on
        # export (model/lora.py). An extra, since peft brings transformers, which the package itself never needs.
        "lora": ["peft==0.21.2"],
        # `megagenome export --quantize int8` (after_training/quantize.py) and --train.optimizer adam8bit on CPU
        # (engine/optimizers.py): torchao, PyTorch's maintained quantization. An extra, not a requirement: importing
        # it logs a line for each CUDA-only kernel library a CPU torch cannot load and torch one deprecation per
        # enum it registers, and transformers imports it whenever it is installed, so every Hugging Face model load
        # (an export, LoRA's peft) printed that noise for users who never quantize.
        "int8": ["torchao==0.18.0"],
        # Loading an export with Hugging Face transformers (AutoModelForCausalLM, AutoTokenizer: the docs' example);
        # exporting needs none of it (megagenome writes the files itself).
        "hf": ["transformers==5.24.0"],
        # The documentation site (mkdocs.yml, docs/): MkDocs builds it, Material is its theme; `mkdocs build
        # --strict` fails on a broken link or anchor between pages. Pinned like the rest, so a new release of
        # either cannot change what --strict accepts (tests/test_docs_site.py).
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.1"],
        # Weights & Biases logging (--log.wandb); optional, imported only when asked for.
        "wandb": ["wandb==0.31.0"],
        # transformers and accelerate are the Hugging Face Trainer peer of benchmarks/peers.py; the package imports
        # transformers only to check an export (megagenome/after_training/export.py, lazily).
        "bench": ["transformers==5.24.0", "accelerate==1.15.0"],
    },
    entry_points={"console_scripts": ["megagenome=megagenome.cli:main"]},
)
