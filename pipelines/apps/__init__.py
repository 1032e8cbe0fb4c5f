"""The apps on top of the engine: the command line ``ragged-vit`` / ``python -m ragged_vit`` and its two commands.

Modules: ``cli`` (the entry point and the demo's parser), ``demo`` (classify images, check the backends agree, time
them), ``validate`` (the ``validate`` command's parser) with ``folder`` (its image-folder data), ``evaluate`` (the run),
``tally`` (the counting), ``distributed`` (``torchrun``) and ``report`` (results, report, CSV); ``arguments`` (the
parser pieces both commands share) and ``images`` (image files, Pillow decoding, timm's eval transform, the demo's
sources). The engine (:mod:`ragged_vit.pipelines`) imports nothing from here.
"""
