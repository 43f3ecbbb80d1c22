"""What `helm upgrade` does to an object that already exists. For kinds without a Go struct, such as RayService,
Helm patches with a JSON merge patch (pkg/kube/client.go createPatch): three-way
(jsonpatch.CreateThreeWayJSONMergePatch over the last release's manifest, the new manifest and the live
object) when threeWayMergeForUnstructured is set, else two-way from the old manifest to the new one. Either
way a field that neither manifest has is left as it is live, and a field the old manifest had and the new
one lacks is deleted. This models the three-way form, the one that also rewrites live drift."""

from __future__ import annotations

from typing import Any

from tests.support.fake_kube import merge_patch

JSON = dict[str, Any]


def three_way_merge_patch(original: JSON, modified: JSON, current: JSON) -> JSON:
    """The RFC 7386 patch Helm sends: deletions from ``original`` to ``modified``, changes from ``current``
    to ``modified``."""
    patch: JSON = {key: None for key in original if key not in modified}
    for key, wanted in modified.items():
        live = current.get(key)
        if isinstance(wanted, dict) and isinstance(live, dict):
            before = original.get(key)
            nested = three_way_merge_patch(before if isinstance(before, dict) else {}, wanted, live)
            if nested:
                patch[key] = nested
        elif live != wanted:
            patch[key] = wanted
    return patch


def helm_upgrade(original: JSON, modified: JSON, current: JSON) -> JSON:
    """The live object after `helm upgrade` from the manifest ``original`` to ``modified``."""
    result: JSON = merge_patch(current, three_way_merge_patch(original, modified, current))
    return result
