"""Running the funnel on a Ray cluster (the optional extra ``speceyes[ray]``).

* :mod:`~speceyes.scale.ray_eval`: ``speceyes eval --ray``, the shards of an eval as Ray
  actors, each writing its shard's run folder, merged into one run at the end; an actor that
  dies is restarted and resumes its shard.
* :mod:`~speceyes.scale.ray_serve`: ``speceyes serve --ray`` (or ``serve run
  speceyes.scale.ray_serve:build_app``), the funnel as a Ray Serve ingress deployment over the
  small and the large model as deployments of their own, each scaled on its own.
* :mod:`~speceyes.scale.session`: connecting to Ray (or starting it here).

Nothing here imports Ray until it runs, so the rest of speceyes works without the extra.
See docs/scaling.md.
"""
