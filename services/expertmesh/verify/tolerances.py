"""How close the platform's logits must be to stock transformers', per dtype: max |Δ logits| over every
position. Two bounds, each for its own claim."""

#: ``expertmesh verify`` (and ``bench dispatch``'s same-answers check) on any checkpoint, real ones
#: included: the platform adds the experts' outputs per group, then across groups, in another order than
#: stock does, and float32 sums in another order differ in their last bits; those differences grow with
#: width and depth, so this bound leaves room for real models (with the same argmax at every position).
VERIFY_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}

#: ``expertmesh verify --sweep``, on the tiny config of every family: stricter in float32, since the
#: sweep's claim is "exact", on models small enough that reordered sums stay within it.
SWEEP_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
