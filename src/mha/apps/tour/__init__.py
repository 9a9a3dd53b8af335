"""`python -m mha tour`: the key figure of each experiment, computed on mha's C kernels, in one
folder (docs/experiments.md lists the experiments).

    python -m mha tour                      # ./mha-tour/index.html, the embedded MiniLM
    python -m mha tour --out figs --quick   # fewer training epochs: the same files, faster

What it writes (PNGs, one GIF, two HTML pages):

  01_sentence_heads.png     four heads of layer 0 of a real model on one sentence
  02_layer_grid.png         every head of a middle layer in a grid (3x4 for 12 heads)
  03_coreference.png        the coreference probe: she -> doctor in every layer and head
  04_ambiguity.png          "The man saw the astronomer with a telescope": which reading each
                            head supports (a prepositional-phrase attachment ambiguity)
  05_head_diversity.png     cosine similarity between the heads of each layer
  06_causal_mask.png        the causal mask and masked attention
  07_concat_projection.png  head outputs -> concatenation -> W_o, with a real layer's numbers
  08_training.png           1 vs 4 vs 8 heads on the period-3 task: loss and accuracy
  09_learned_patterns.png   what the 4 heads learned
  10_speed.png              1/4/8/16 heads, batch 16 x 128 tokens x 256, in turns
  11_pruning.png            the head-pruning procedure: the least important head out, one at a
                            time, until accuracy drops > 1 point
  12_beyond_attention.png   raw weights, rollout, attention flow and value norms side by side
  13_value_norms.png        weight against value norm on the special tokens (Kobayashi et al.)
  14_clark_metrics.png      where every head attends (Clark et al.'s statistics)
  15_head_map.png           the heads on a map of their Jensen-Shannon distances
  attention_layers.gif      one head across the layers, one frame per layer
  head_view.html            the interactive head view (BertViz-style), self-contained
  model_view.html           every layer and head at once
  index.html                all of the above, with a sentence each

Progress goes to stderr; the list of files to stdout. Exit status: 0 on success, 2 for a bad
option, an unwritable folder or a model that cannot be loaded (with a one-line message).

The tour is the table `FIGURES` (figures.py): each entry names a file, its title in index.html
and the function that computes and draws it (from the results the figures share, `Tour`). A new
figure is a function and one entry. schedule.py draws them in one or two processes, page.py
writes index.html, command.py is `run` and the command line.

Two processes draw at once (`--jobs`, default 2 on two cores or more): a worker process trains
the small models and draws the figures of the training (the entries of a `group`) while this
one draws the pretrained model's, and takes figures from the end of the table when it is done;
the speed figure (`alone`) is timed last, with no other figure running.
"""
from .command import main, run
from .figures import FIGURES, FILES, Figure, Tour, TourError

__all__ = ["main", "run", "FIGURES", "FILES", "Figure", "Tour", "TourError"]
