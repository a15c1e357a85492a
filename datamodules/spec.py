"""Registry specs of this method folder (torch-free; listed in ``recipes.registry.SPEC_MODULES``)."""

from __future__ import annotations

from litctx_common.specs import DataSpec


ERA5_TINY = {"variables": ["geopotential", "2m_temperature"], "levels": [500, 850], "batch_size": 4,
             "train_batches": 2, "eval_rollout": 2,
             "train_period": ["2000-01-01", "2000-01-20"], "val_period": ["2000-01-21", "2000-01-25"],
             "test_period": ["2000-01-26", "2000-01-30"],
             "synthetic": {"days": 30, "n_lat": 8, "n_lon": 16}}


DATAMODULES = [
    DataSpec(
        name="lcube",
        target="datamodules.lcube:LCubeDataModule",
        config="datamodules.lcube:LCubeDataConfig",
        description="hierarchical Gaussian sequences with exact conditionals (generated on the fly)",
        tiny={"length": 32, "batch_size": 8, "train_batches": 4, "val_sequences": 16, "test_sequences": 16},
        paper="lightning_modules.lcube.spec:LCUBE_PAPER",
    ),
    DataSpec(
        name="pcfg",
        target="datamodules.pcfg:PCFGDataModule",
        config="datamodules.pcfg:PCFGDataConfig",
        description="strings of a seeded fixed-depth binary PCFG, exact conditionals on the evaluation sets",
        tiny={"depth": 3, "symbols": 4, "batch_size": 16, "train_batches": 4, "val_size": 32, "test_size": 32},
        paper="lightning_modules.pcfg.spec:PCFG_PAPER",
    ),
    DataSpec(
        name="meg",
        target="datamodules.meg:MEGDataModule",
        config="datamodules.meg:MEGDataConfig",
        description="MEG through MNE (FIF/CTF/KIT/BTi), 50-Hz cache, long contexts or word windows; "
                    "synthetic Neuromag study by default",
        tiny={"context_s": 6.0, "stride_s": None, "words_per_sample": 4, "subjects": None, "val_subjects": None,
              "test_subjects": None, "val_fraction": 0.1, "test_fraction": 0.1,
              "synthetic": {"subjects": 2, "duration_s": 120.0, "locations": 3, "vocab": 12}},
        requires=("mne",),
        extra="meg",
        paper="lightning_modules.meg.spec:MEGXL_PAPER",
    ),
    DataSpec(
        name="copy_retrieval",
        target="datamodules.synth.copy_retrieval:CopyRetrievalDataModule",
        config="datamodules.synth.copy_retrieval:CopyRetrievalConfig",
        description="synthetic long-range copy and key-value retrieval token sequences (small vocabulary, any "
                    "length), scored on the copied / retrieved tokens; retrieval probes per length",
        tiny={"seq_len": 32, "batch_size": 2, "train_batches": 2, "eval_size": 2, "passkey_samples": 2},
    ),
    DataSpec(
        name="multi_key",
        target="datamodules.synth.multi_key:MultiKeyDataModule",
        config="datamodules.synth.multi_key:MultiKeyConfig",
        description="multi-key retrieval (LoSA's KV-inflation task): the answer block concatenates the values "
                    "of several queried keys; synthetic ids or a tokenizer's single-token words",
        tiny={"symbols": 16, "keys_per_question": 2, "value_tokens": 2, "block_size": 4, "context_tokens": 64,
              "eval_context_tokens": [64, 96], "batch_size": 2, "train_batches": 2, "eval_size": 2},
        paper="lightning_modules.losa.spec:LOSA_PAPER",
        tokenizer_arg="tokenizer",
    ),
    DataSpec(
        name="text",
        target="datamodules.text:TextDataModule",
        config="datamodules.text:TextDataConfig",
        description="a text corpus (pydoc_data topics by default, or .txt/.jsonl) tokenised and packed into "
                    "blocks, split by document",
        tiny={"seq_len": 64, "batch_size": 2, "train_batches": 2, "max_documents": 12,
              "val_fraction": 0.2, "test_fraction": 0.2},
        requires=("transformers",),
        extra="llm",
        tokenizer_arg="tokenizer",
    ),
    DataSpec(
        name="longctx_suite",
        target="datamodules.longctx_tasks:LongContextSuiteDataModule",
        config="datamodules.longctx_tasks:SuiteConfig",
        description="RULER-style needle, multi-key/value, variable-tracking, common-word and QA tasks on "
                    "real-text haystacks at chosen lengths, chat-formatted",
        tiny={"lengths": [256, 384], "samples_per_cell": 1, "tasks": ["niah_single", "qa_facts"], "train_samples": 1},
        requires=("transformers",),
        extra="llm",
        paper="lightning_modules.llm.eval.spec:RULER_PAPER",
        tokenizer_arg="tokenizer",
    ),
    DataSpec(
        name="rag_tasks",
        target="datamodules.rag_tasks:RAGDataModule",
        config="datamodules.rag_tasks:RAGDataConfig",
        description="RAG questions: generated multi-document QA with cross-document bindings and distractor "
                    "chains, a citation task with gold sentences, LongBench-Cite files, or a folder of documents "
                    "with a questions file",
        tiny={"samples": 2, "distractors": 1, "chunk_words": 12},
        requires=(),
        extra="llm",
        paper="lightning_modules.prophetkv.spec:PROPHETKV_PAPER",
    ),
    DataSpec(
        name="persistbench",
        target="datamodules.persistbench:PersistBenchDataModule",
        config="datamodules.persistbench:PersistBenchDataConfig",
        description="PersistBench samples: 150+ written for this project (cross-domain leakage, sycophancy, "
                    "beneficial memory use; filler memories outside the query's domain), or a JSONL file",
        tiny={"samples": 3, "failure_types": ["cross_domain", "sycophancy"]},
        requires=(),
        extra="llm",
        paper="lightning_modules.persistbench.spec:PERSISTBENCH_PAPER",
    ),
    DataSpec(
        name="dialogue",
        target="datamodules.dialogue:DialogueDataModule",
        config="datamodules.dialogue:DialogueDataConfig",
        description="multi-session dialogues with interleaved threads whose facts are introduced, revised and "
                    "recalled (generated, gold answers and distances), or real multi-session chat JSON "
                    "(sessions of speaker turns: LoCoMo, LongMemEval, MSC layouts), served turn by turn",
        tiny={"train_dialogues": 4, "val_dialogues": 1, "test_dialogues": 1, "turns": 6, "threads": 2,
              "min_gap": 1},
        requires=("transformers",),
        extra="llm",
        paper="lightning_modules.cdic.spec:CDIC_PAPER",
        tokenizer_arg="tokenizer",
    ),
    DataSpec(
        name="multihop",
        target="datamodules.multihop:MultiHopDataModule",
        config="datamodules.multihop:MultiHopDataConfig",
        description="multi-hop questions (2-3 linked facts across documents, gold supporting sentences) over a "
                    "generated corpus of people, organisations, cities and books, or a folder of documents with "
                    "a questions file",
        tiny={"samples": 2, "people": 12, "organisations": 4, "schools": 2, "publishers": 2, "cities": 4,
              "books": 6},
        requires=(),
        extra="llm",
        paper="lightning_modules.hgmem.spec:HGMEM_PAPER",
    ),
    DataSpec(
        name="era5",
        target="datamodules.era5:ERA5DataModule",
        config="datamodules.era5:ERA5DataConfig",
        description="ERA5 in WeatherBench2 layout (Zarr/NetCDF, CDS names normalised) through xarray; a "
                    "synthetic advection-diffusion ERA5 with an exact climatology by default",
        tiny=ERA5_TINY,
        requires=("xarray", "zarr"),
        extra="weather",
        paper="lightning_modules.emformer.spec:EMFORMER_PAPER",
    ),
    DataSpec(
        name="event_frames",
        target="datamodules.events:EventFramesDataModule",
        config="datamodules.events:EventFramesConfig",
        description="synthetic DVS-like temporal-order event streams binned into T frames",
        tiny={"steps": 8, "train_size": 64, "val_size": 32, "test_size": 32, "batch_size": 16},
        paper="lightning_modules.spiking.spec:TS_PAPER",
    ),
    DataSpec(
        name="digits_frames",
        target="datamodules.digits:DigitsFramesDataModule",
        config="datamodules.digits:DigitsFramesConfig",
        description="scikit-learn digits (offline) shown row by row or statically over T frames",
        tiny={"steps": 8, "batch_size": 16, "train_batches": 4},
        paper="lightning_modules.spiking.spec:TS_PAPER",
        requires=("sklearn",),
        extra="spiking",
    ),
    DataSpec(
        name="timeseries",
        target="datamodules.timeseries:TimeSeriesDataModule",
        config="datamodules.timeseries:TimeSeriesConfig",
        description="UCR/UEA .ts classification sets (GunPoint, BasicMotions, ... shipped with aeon) over T frames",
        tiny={"steps": 16, "batch_size": 8, "train_batches": 3},
        paper="lightning_modules.spiking.spec:TS_PAPER",
    ),
]
