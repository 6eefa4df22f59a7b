"""``expertmesh verify``: the platform against stock transformers, on one checkpoint (``check``) or every MoE
family (``sweep``)."""
