"""Records of families tp_train plans with no built-in entries, but whose small config (the zoo's, and `model=hf`'s)
needs fields of its own: a layout that ties two generic sizes, a default config that builds no model that runs, or
a position table longer than the blocks."""

from __future__ import annotations

from tp_train.plan.deciding.families.spec import FamilySpec

# VibeVoice's audio tokenizers (the sub-configs of vibevoice and vibevoice_asr): by default 6 downsampling stages
# that double 32 filters up to 2048 channels (1.0 and 0.7 billion parameters, 8.4 GB a rank at tp 2 with the
# unsharded copy: two such families at once were killed for memory); 2 stages of 4 to 16 filters, one block each.
VIBEVOICE_TOKENIZER = dict(num_filters=4, downsampling_ratios=[2, 2], depths=[1, 1, 1])

RECORDS = (
    # MiMo-V2-Flash's sliding-window layers have twice the kv heads, which must not exceed the query heads.
    FamilySpec(model_type="mimo_v2_flash", zoo_fields=dict(num_key_value_heads=2)),
    # As many kv heads as the 4 query heads: latent attention that repeats keys by heads // kv heads yet makes one
    # per query head (DeepSeek-V3's, whose config takes None for it; these refuse None), and Dots3's text model,
    # whose config refuses fewer. `model=hf`'s 2 kv heads failed their one batch (issue 54).
    *(
        FamilySpec(model_type=name, zoo_fields=dict(num_key_value_heads=4))
        for name in ("axk2", "deepseek_v32", "glm_moe_dsa", "dots3_note_text")
    ),
    # Reformer's causal LM asserts is_decoder (the default config is an encoder's); its axial position embeddings
    # split the hidden width in two and factor the longest sequence (64 = 8 x 8).
    FamilySpec(
        model_type="reformer", zoo_fields=dict(is_decoder=True, axial_pos_embds_dim=(16, 16), axial_pos_shape=(8, 8))
    ),
    # CodeGen reshapes qkv_proj's output into a hard-coded 4 groups of [q; v; k] (`mp_num`), on local heads too: each
    # rank holds its share of every group, so tp x 4 must divide the heads (16 of 2, a rotary width that fits).
    FamilySpec(model_type="codegen", zoo_fields=dict(num_attention_heads=16, rotary_dim=2)),
    # BLT's random patcher gives every byte an entropy (about 4.4) above the default threshold (1.34): every byte its
    # own patch, and a patch querying its one byte shows nothing of its queries; above ln(vocab) only the first byte
    # is a patch of its own, the others one long patch. Above ln(300) = 5.7 too: `--train` runs the data's 300-token
    # vocabulary, where 5.0 (above ln(128), the zoo's) left every byte its own patch again and no plan was found.
    FamilySpec(model_type="blt", zoo_fields=dict(patching_threshold=8.0)),
    FamilySpec(model_type="vibevoice_acoustic_tokenizer", zoo_fields=VIBEVOICE_TOKENIZER),
    FamilySpec(model_type="vibevoice_acoustic_tokenizer_encoder", zoo_fields=VIBEVOICE_TOKENIZER),
    # BigBird's block-sparse attention needs sequences longer than (5 + 2 x random blocks) x its block size (704 tokens
    # by default); at the zoo's 32 to 64 it swaps itself for full attention in its first forward (a new module, which
    # the plan check refuses through train.py): the tiny config asks for the full attention it would run.
    FamilySpec(model_type="big_bird", zoo_fields=dict(attention_type="original_full")),
    # X-MOD's language adapters need a language for inputs that name none (`set_default_language`, a config field);
    # its positions, as RoBERTa's, count on from the pad id.
    FamilySpec(model_type="xmod", zoo_fields=dict(default_language="en_XX"), positions_after_padding=True),
    # RoBERTa's embeddings number a token's position from the pad id + 1 (checkpoints hold 514 rows for 512 tokens):
    # `model=hf` at `data.block_size` positions failed in the first forward (`index 64 is out of bounds`, issue 54).
    *(
        FamilySpec(model_type=name, positions_after_padding=True)
        for name in ("roberta", "camembert", "data2vec-text", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl")
    ),
    # Defaults that build no model that runs (transformers 5's defaults lack what every checkpoint sets):
    FamilySpec(model_type="lfm2_moe", zoo_fields=dict(layer_types=["conv", "full_attention"])),  # no layer kinds
    # rotary parameters are looked up per layer kind, and the default has none
    FamilySpec(
        model_type="cohere_compass_text",
        zoo_fields=dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    ),
)
