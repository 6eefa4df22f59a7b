"""Query classifier: the domain of a request (code, math, legal, ...), for the routing policies.

``default_classifier()`` is what a router uses; see ``model`` for the model and why it was chosen.
"""

from expertmesh.classifier.cache import default_classifier
from expertmesh.classifier.model import Classification, QueryClassifier

__all__ = ["Classification", "QueryClassifier", "default_classifier"]
