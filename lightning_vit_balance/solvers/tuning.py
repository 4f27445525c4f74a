"""Every tuning constant of the solvers, in one place, each with the reason for its value.

None of these changes which plans are valid (every image encoded once, the cap rules), only how
hard the solvers look and when they stop. Figures quoted are from ``make bench``'s scenarios.
"""

from __future__ import annotations

__all__ = [
    "AIM",
    "BEST_FIT_RECEIVERS",
    "BRING_HOME_CANDIDATES_LEAN",
    "BRING_HOME_PASSES",
    "BRING_HOME_UP_TO",
    "EPS",
    "EXCHANGE_RECEIVERS",
    "EXCHANGE_SIZE",
    "FIT_FROM_PER_RANK",
    "FIT_TRIES",
    "GROUP_EXCHANGES_UP_TO",
    "HOME_FIRST_FROM",
    "HOME_FIRST_HEAPS_UP_TO_RANKS",
    "LEAN_SLACK",
    "PAIRED_ABOVE",
    "PAIRED_FROM_PER_RANK",
    "PAIRED_ROUNDS",
    "PAIRED_ROUNDS_FEW",
    "PAIRED_UP_TO",
    "POLISH_ABOVE_PER_RANK",
    "PYTHON_COSTS_UP_TO",
    "REFINE_MIN_STEP",
    "REFINE_UP_TO_ABOVE",
    "RELABEL_ROUNDS",
    "RELAX_WITHIN",
    "REPAIR_FROM_WITHIN",
    "REPAIR_LEFT_UP_TO",
    "REPAIR_RANKS_UP_TO",
    "REPAIR_STEPS",
    "REPAIR_UP_TO",
    "SHED_AIM",
    "SLACK",
    "SPLIT_SEARCH_FROM",
    "SPLIT_SEARCH_UP_TO",
    "VECTORISE_ABOVE",
]

#: Relative tolerance for "a rank is above the target" and "a plan is within the limit": loads
#: are sums of floats, and the same total summed in a different order may differ in its last bits.
EPS = 1e-9

#: The locality solver accepts a plan whose makespan is within this fraction of the lower bound
#: (or, when the bound is out of reach, of the best makespan found, the LPT's included) if that
#: plan moves fewer pixel rows. 0.4% keeps it inside the target "at most 0.5% above the seed's
#: makespan" with room for rounding.
SLACK = 0.004

#: The repair's second target, above the pigeonhole bound, when it cannot bring every rank within
#: :data:`SLACK` of it: such a plan still has to come within :data:`SLACK` of the seed's makespan
#: (which then runs) to be kept. 1% is below the seed's own median distance from the bound on
#: batches of similar sizes (1.4-4% at P = 4-64, 1-8 images per rank), so the repaired plan
#: usually qualifies.
LEAN_SLACK = 0.01

#: Home-first aims at half the slack above its reference, so that refinement and the empty-rank
#: fix-up, which may add a little, still land within the full slack.
AIM = 0.5 * SLACK

#: Shed-and-place sheds each rank down to the lower bound plus this much: most of the slack, so a
#: rank keeps every image of its own that the accepted makespan allows (an image that never leaves
#: need not be brought home later); the last tenth absorbs the images placed on the lightest ranks.
SHED_AIM = 0.9 * SLACK

#: When the lower bound is out of reach, home-first is retried against the reachable target only
#: if its plans came within this fraction of the new acceptance limit. Further away the retry
#: rarely qualifies (5 of 16 such batches) and costs a full candidate.
RELAX_WITHIN = 0.01

#: Above this many images per rank on average (no cap, at most :data:`BRING_HOME_UP_TO` images),
#: selection brings every plan's moved images home, also a plan that reached the bound as placed
#: (mixed batches, 1-16 per rank, P = 32: 47.7% -> 46.6% of all rows moved, within half the
#: seed's 94.9%). A *thorough* search used to run there instead (home-first in blocks of P, P/2
#: and P/4 images next to shed-and-place, every plan refined): on 9-32 images per rank at P = 2-32
#: the lean order with home-first for large images plans 1.1-8.5x faster, at the same makespans
#: or lower (similar sizes: the repair's 0.4% above the bound where the blocks ended up to 1%
#: above it) and within 7 points of all rows moved either way.
POLISH_ABOVE_PER_RANK = 8

#: Above this many images (and without a patch cap) the locality solver switches to its numpy
#: variants (blocks of images, destinations in arrays), which keep P=1024 x 8 images within a
#: few milliseconds; below it the exact Python heaps are cheaper than the numpy calls. With a cap
#: the solver stays on the heaps at every size: the blocks cannot check the cap.
VECTORISE_ABOVE = 512

#: Up to this many ranks the numpy variants run home-first with the exact heaps
#: (:func:`~.locality.home_first`) instead of in blocks of ``P`` images: a block costs a dozen
#: numpy calls, worth it only when it places many images at once. With few ranks and many images
#: per rank (videos split by temporal step) the blocks made the plan slow: at P = 2 with ~1,000
#: images per rank 43-46 ms, with the heaps 1.4-1.6 ms; at P = 8 x 1,000 51-71 ms against 7-10 ms;
#: at P = 32 x 64-1,000 2-4x faster. At P = 64 the two are within 1.5x either way.
HOME_FIRST_HEAPS_UP_TO_RANKS = 32

#: With at least this many images per rank on average (and more than :data:`VECTORISE_ABOVE`), the
#: locality solver tries :func:`~.locality.shed_and_fit` first: long videos split by temporal step,
#: many small images. On 103 random batches of 513-40,000 images (P = 2-256, 16-512 per rank) it
#: planned 58 within the slack of the bound, moving within 1-2% of the fewest rows any plan that
#: good must move, where home-first moved 1.4-2.1x that many (all 103: 25% of all rows instead of
#: 34%). Below this the images are too coarse for it: at 16 per rank it fitted 0 of 12 batches, at
#: 32 1 of 12, and trying it from 16 made those 103 plans take 23% longer in all.
FIT_FROM_PER_RANK = 32

#: The tries of :func:`~.locality.shed_and_fit`, in order: ``(shed aim, fit slack)``, the ranks above
#: the lower bound shed down to ``(1 + shed aim)`` times it and the shed images fit under
#: ``(1 + fit slack)`` times the pigeonhole bound. The tight try first: on 48 long-video batches
#: it fitted 31 at a median makespan 1.0010 of the bound; the loose one (the slack itself) fitted
#: 37, at 1.0039. The rows moved are the same (0.21 of all rows either way).
FIT_TRIES = ((0.0, 0.25 * SLACK), (AIM, SLACK))

#: Up to this many images a :class:`~lightning_vit_balance.CostModel` prices them in plain Python
#: (:meth:`~lightning_vit_balance.CostModel.costs`, the same floats): numpy's fixed cost per call,
#: a few microseconds for the dozen calls of an array evaluation and its checks, is most of a plan
#: for a few ranks, while the Python loop grows by about 0.1 us per image and overtakes it near here.
PYTHON_COSTS_UP_TO = 64

#: Up to this many images (no cap) the chosen plans get :func:`~.locality.bring_home` passes:
#: a pure-Python pass per plan, affordable up to where the numpy variants take over.
BRING_HOME_UP_TO = VECTORISE_ABOVE

#: Passes of :func:`~.locality.bring_home` over the moved images. Each pass changes fewer plans
#: (of 353 calls, passes 1 to 5 changed 307, 111, 41, 16 and 2); three bound the cost.
BRING_HOME_PASSES = 3

#: At most this many plans, fewest rows moved first, get :func:`~.locality.bring_home` in the lean
#: order, where at most three plans compete (a pass over a plan costs about a heap LPT). Bringing
#: the third home too changed none of 960 plans (1-8 images per rank, P=2-64, ``make bench``'s four
#: scenarios). With more than :data:`POLISH_ABOVE_PER_RANK` images per rank every plan gets it.
BRING_HOME_CANDIDATES_LEAN = 2

#: Proposal rounds of the greedy matching that renames LPT bins to home ranks. Every round matches
#: at least one bin; bins left after the last take the free ranks in order, which costs rows (the
#: images they hold move), never balance (renaming ranks changes no load).
RELABEL_ROUNDS = 8

#: A refinement step counts as an improvement only if it lowers the larger of the two loads by
#: more than this: the seed's own threshold, kept so that the LPT solver is the seed's algorithm.
REFINE_MIN_STEP = 1e-12

#: In the lean order (few images per rank) the seed's pairwise refinement finishes shed-and-place's
#: plan first only when at most this many ranks are above the limit; with more, the repair comes
#: first. Each refinement step relieves one rank, towards the lightest, and stops at the seed's
#: tolerance: with three or more ranks above it brought the plan within the limit in 7 of 459
#: batches (1-8 images per rank, P = 4-64, the four scenarios), with two in 32 of 153.
REFINE_UP_TO_ABOVE = 2

#: In the lean order, when shed-and-place misses the bound with more than
#: :data:`REFINE_UP_TO_ABOVE` ranks above it (or half the ranks or more) and the costliest image
#: is at least this share of the pigeonhole bound, home-first aimed at the bound comes next. With
#: images that large (documents, long videos) at most a few fit a rank: placing them largest
#: first, as home-first does, reaches the bound where shed-and-place's placement lands 5-28% above
#: it and the refinement and the repair fail. Of such batches (P = 2-64, 1-16 images per rank,
#: the four scenarios) it reached the bound in 79 of 133 from this share, in 1 of 232 below it
#: (images of similar sizes), where it would only add its cost.
HOME_FIRST_FROM = 0.5

#: :func:`~.repair.repair` tries single exchanges with this many receivers, the least room that
#: suffices first, then only with those at power-of-two places in that order: a bound on a relief's
#: work with hundreds of ranks. Up to 65 ranks every receiver is tried. At P = 128-192 (similar
#: sizes, 1-8 images per rank) 16 receivers left more plans at the looser target (mean makespan /
#: bound 1.0065 and 1.0079 against 1.0050 and 1.0070), and then the seed's LPT runs too.
BEST_FIT_RECEIVERS = 64

#: The repair runs on the numpy variants' batches (more than :data:`VECTORISE_ABOVE` images) up to
#: this many images and :data:`REPAIR_RANKS_UP_TO` ranks. Without it, similar sizes there stay
#: 2.6-5% above the bound (P = 128-256, 1-16 images per rank), or at 8 images per rank the seed's
#: relabelled plan moves 85% of all rows; with it they reach 1.004 and move 15-38% of rows, at
#: 3.7-9.4 ms a plan (1.8-3.8 ms before); on 54 random batches of 65-256 ranks with 0-16 images
#: each, median 3.6-6.3 ms and worst 12.9 ms (before: 2.4-2.8 and 5.6). Its work grows with the
#: ranks it relieves (about half) and the images they hold: 10 ms at P = 256 with 1-16 per rank
#: (2,160 images), 13 ms at P = 384 and 26 ms at P = 512 with 1-8, past the 10 ms budget.
REPAIR_UP_TO = 2048

#: See :data:`REPAIR_UP_TO`.
REPAIR_RANKS_UP_TO = 256

#: On those batches the repair starts only from a placement within this fraction of the bound.
#: Images of similar sizes leave it 2.5-7.5% above (P = 128-256); far above, ranks hold images that
#: no exchange of one or two images can spread (two document pages of half the bound each, with
#: every receiver's room a tenth of it): on 4 of 7 mixed batches at P = 128 x 8 the placement was
#: 12-17% above, the repair reached neither target and cost 1.3-3.6 ms for nothing.
REPAIR_FROM_WITHIN = 0.1

#: At two ranks with at most this many images the repair runs only when some split of the images
#: reaches its last target (searched exactly, meet in the middle: 2 x 4,096 subsets at 24, 0.4 ms;
#: 13-25 us at 8-16 images). On random two-rank batches 43-46% of the repairs were skipped; with 8
#: images per rank the slowest plans took 0.36-0.62 ms instead of 1.3-2.0 ms.
SPLIT_SEARCH_UP_TO = 24

#: ... and only when the costliest image is at least this share of the target: images that small
#: leave many splits near the middle, and searching them made plans of 8 similar sizes per rank
#: 20-27% slower in all, for nothing. Every repair skipped on 1,350 random two-rank batches had
#: its costliest image at about a third of the target or more.
SPLIT_SEARCH_FROM = 0.25

#: :func:`~.repair.repair` exchanges groups of at most this many images each way between two
#: ranks. On 147 batches of similar sizes that shed-and-place left above the bound (1-8 images per
#: rank, P = 2-64), single images alone reached the first target in 34, pairs in 102, triples in
#: 108 at 1.1-1.8x the time.
EXCHANGE_SIZE = 2

#: :func:`~.repair.repair` tries group exchanges with this many receivers at most, the roomiest
#: first, once no single move or swap relieves a rank whole: group searches are its costliest
#: step, and 4 receivers reached the first target in 2 more of those 147 batches than 2 did.
EXCHANGE_RECEIVERS = 2

#: :func:`~.repair.repair` exchanges groups only between ranks holding at most this many images
#: each. A rank's groups grow as the square of its images and the pairs of groups tried as the
#: square of that; only the first of the groups alike in cost and rows is tried, which keeps frames
#: of one size cheap, but images of many sizes are not alike. Beyond this many single moves and
#: swaps shift cost in fine steps anyway. At P = 4-16 with 8-48 images of two sizes per rank the
#: slowest of 8 plans took 6-12 ms (before: 6-440 ms), at the same worst makespans but at 32 per
#: rank (1.0053 of the bound against 1.0038).
GROUP_EXCHANGES_UP_TO = 32

#: :func:`~.repair.repair` moves on to its next target when a rank is still above the current one
#: after this many exchanges (each shifts as much cost as its receiver has room for). Of those 147
#: batches, 3 reached the first target in 7 fewer than 4; 6 in 2 more, at up to 4% more time.
REPAIR_STEPS = 4

#: Beyond :data:`REPAIR_UP_TO` images or :data:`REPAIR_RANKS_UP_TO` ranks, up to this many images
#: (and from :data:`PAIRED_FROM_PER_RANK` per rank), the repair starts with
#: :func:`~.paired.paired_exchanges`, in numpy. Without it, similar sizes there stayed 1.5-6% above
#: the bound, or the seed's relabelled plan won and moved 80-90% of all rows. With it, on 30
#: random batches of 257-1024 ranks with 0-16 images each: median makespan / bound 1.016 ->
#: 1.004, median rows moved 82% -> 34%, median plan 5.6 -> 6.0 ms, worst 11.1 -> 14.8 ms. At
#: P = 1024 x 8 (8,192 images) 6.3 -> 7.6 ms and 86% -> 20% of rows; at P = 1024 with 1-16 per
#: rank (8,900 images) 9.3 -> 6.8 ms (the seed's LPT no longer runs). At P = 4096 with 1-16 per
#: rank (35,000 images) the rounds alone took 29 ms.
PAIRED_UP_TO = 10_000

#: Rounds of :func:`~.paired.paired_exchanges`, each about 0.3-1 ms at 8,000 images. Ranks left
#: above the target after 2, 4 and 6 rounds (similar sizes, P = 512-1024, 8 or 1-16 per rank):
#: 8-39, 0-3 and 0-2 of 30-460 at the start.
PAIRED_ROUNDS = 6

#: After the paired exchanges the Python repair runs when at most this many ranks are still above
#: the target (else the seed's LPT is the reference, as without a repair). On 63 random batches
#: of 257-1024 ranks with up to 64 left it reached the first target in 61 and the looser one in
#: 2, in at most 9.3 ms (20 ms in a second run of the same batches: this VM's speed drifts).
REPAIR_LEFT_UP_TO = 64

#: When the paired exchanges follow and the numpy placement is more than this above the bound,
#: the seed's refinement does not run first: one rank at a time it rarely gets there with images
#: of similar sizes (2.4-7% above), and it cost about 1 ms at P = 1024 x 8. Mixed batches land
#: within 1.1% of the bound (P = 300-1024), so they keep it.
PAIRED_ABOVE = 0.02

#: From this many images per rank on average the paired exchanges and the repair aim at the
#: slack above the bound; below it, at the lean limit alone (:data:`LEAN_SLACK`), with
#: :data:`PAIRED_ROUNDS_FEW` rounds. On 90 random batches of similar sizes (257-1024 ranks):
#: from 5 per rank, 61 of 64 reached the slack and 2 the lean limit; below 5, 2 of 26 reached
#: the slack and 4 the lean limit, the other 20 cost 1.6-8.9 ms for nothing. Aimed at the lean
#: limit alone, 25-31 of 35 such batches reached it.
PAIRED_FROM_PER_RANK = 5

#: Rounds of :func:`~.paired.paired_exchanges` below :data:`PAIRED_FROM_PER_RANK` images per rank,
#: where whole images are coarse and ranks need more partners. On 30 random batches of 257-1024
#: ranks, 0-10 images each: 10, 20 and 30 rounds brought 21, 25 and 26 within the lean limit
#: (before: none; median makespan / bound 1.055 -> 1.010), in a median 7.9, 8.6 and 8.8 ms a plan
#: (4.2 ms before). The rows moved rise from 31% to 50% of all: the plans that stayed 5% above
#: the bound moved fewer.
PAIRED_ROUNDS_FEW = 20
