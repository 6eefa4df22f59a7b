"""Every command of ``expertmesh`` and the kubectl plugin. Imported by nothing else: libraries never depend on a
command."""
