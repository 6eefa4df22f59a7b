"""Settings only: the typed configuration of every process, where each setting comes from
(flags > EXPERTMESH_* > --config file > defaults), and the flags that set them."""
