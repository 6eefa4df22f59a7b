"""An expert group: some logical experts of some MoE layers, served over gRPC.

``expertmesh.models.hosted_experts.HostedExperts`` holds the weights and computes; ``service`` wraps it in
the ``expertmesh.v1.ExpertGroup`` gRPC service; ``deployment`` runs one as a Ray
Serve deployment.
"""
