"""Tree verification (DDTree: Ringel & Romano, arXiv 2604.12989) from one draft forward: the tree, its
mask, and the rules that accept a path of it. Plain torch; worker.tree_step runs them (issue 29).

The draft fills its block in one forward, so block row d (d = 1 … B-1) comes with a whole distribution
over the vocabulary, and that distribution does not depend on which tokens were chosen at rows before d.
A chain verifies only the top-1 token of every row. The tree spends the same verify rows on the most
likely sequences instead: a node at depth d is a token of row d, its path from the root a candidate
continuation, scored by the sum of its tokens' draft log-probabilities.

    build_tree(logprobs [D, V], k, budget) -> Tree   the `budget` highest-scoring paths (the root included),
                                                      from the top-k tokens of each row, best first
    Tree.tokens [N], parents [N], depths [N]          node 0 is the root (the bonus token, depth 0); a node's
                                                      parent comes before it
    ancestor_mask(parents) [N, N]                     node i attends to node j when j is i or an ancestor of
                                                      i (the verify forward's mask within the block)
    accept_tree_greedy(tree, target_next [N])         the longest root path whose every token is the target's
                                                      own choice after its parent, + the target's next token
    accept_tree_sampled(tree, p [N, V], u [D + 1])    the same path drawn as the target samples: exact

For a batch of bs requests with one node budget N (the verify forward's rows per request):

    build_trees(logprobs [bs, D, V], k, N)            tokens, parents, depths [bs, N] (root tokens: the bonus)
    tree_verify_mask(parents, prefix_lens, L)         [bs, 1, N, L]: node i sees the committed prefix and its
                                                      ancestors in the block, which sits at prefix … prefix+N-1
    flat_verify_mask(parents, prefix_lens)            the same as SGLang's verify custom_mask (what its CUDA
                                                      attention backends read): flat, per request [N, prefix+N]
    TREE_MASK_ATTR                                    the verify input's attribute that carries the ancestor
                                                      masks [bs, N, N] to the CPU engine's verify attention
    accept_trees_greedy(tokens, parents, target_next) accept_tree_greedy for the batch at once
    accept_trees_sampled(tokens, parents, p_node, u)  accept_tree_sampled for the batch, a depth at a time
    path_order(paths, N)                              [bs, N]: the accepted path's nodes in order, then the
                                                      others: where each node's KV slot goes in req_to_token

The accepted path's K/V stays where the verify wrote it (page size 1): the window's req_to_token entries
prefix … prefix+N-1 are permuted by path_order, so that position prefix + j holds the slot of the path's
j-th node. The other nodes' slots stay in the row, after the path, as the chain's unaccepted rows do: the
next step's block reuses them and the request's release frees them, once (freeing them here would free
them twice). With pages of more than one slot a row must stay page-aligned, so there the path's K/V is
copied to the slots of positions prefix … prefix + len(path) - 1 instead (worker.keep_path).

Sampling: at the current node draw x from the target's distribution p there; if a child holds x, move to it
and go on, else x is the next token and the walk ends. That is recursive rejection over the children with
each child proposed as a point mass (SpecInfer's rule with q = δ(child): child c is accepted with probability
p_res(c), and a rejection removes c from the residual), so every committed token is distributed exactly as the
target's: tests/test_tree.py enumerates it. The tree's candidates are chosen by the draft, deterministically;
only the target's draws are random.
"""

from __future__ import annotations

import dataclasses
import heapq

import torch

# The DFLASH verify input (SGLang's DFlashVerifyInput) carries a tree's ancestor masks [bs, N, N] in this attribute
# to plugin.torch_native_forward_extend, the CPU engine's verify attention. SGLang's CUDA backends would read its
# custom_mask (flat_verify_mask's layout) instead; the worker leaves that None while tree verification is refused
# on a GPU (docs/tree-verification-plan.md, step 4). The CPU hook never reads custom_mask, which SGLang itself may
# set (padded, for CUDA graphs) on paths this worker does not take.
TREE_MASK_ATTR = "dflash_tree_mask"


@dataclasses.dataclass
class Tree:
    tokens: torch.Tensor  # [N] int64: node 0 is the root (its token is the bonus token, filled by the caller)
    parents: torch.Tensor  # [N] int64: -1 for the root; parents[i] < i
    depths: torch.Tensor  # [N] int64: 0 for the root; a node of depth d holds a token of block row d
    scores: torch.Tensor  # [N] float: the sum of the path's draft log-probabilities (0 for the root)

    @property
    def size(self) -> int:
        return self.tokens.numel()

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()


def build_tree(logprobs: torch.Tensor, k: int, budget: int, root_token: int = -1) -> Tree:
    """logprobs [D, V]: the draft's log-distribution at block rows 1 … D -> the tree of the `budget` best paths
    (node count, the root included; fewer when the k^1 + … + k^D paths there are run out).

    Best first: a candidate is a path of ranks (r_1 … r_d), r_i < k the rank of its token at row i; its score
    is the sum of those tokens' log-probabilities. Popping the best candidate adds its node; its successors
    are its first child (r_1 … r_d, 0) and its next sibling (r_1 … r_d + 1). Both score no more than it, so
    candidates leave the heap in descending score, and a node's parent is always taken before it."""
    D = logprobs.shape[0]
    k = min(k, logprobs.shape[1])
    top_lp, top_ids = logprobs.float().topk(k, dim=-1)  # [D, k] each, descending
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
    # heap of (-score, tie-break, depth d (1-based), rank at d, parent node, parent's score)
    heap = [(-top_lp[0][0], 0, 1, 0, 0, 0.0)] if D > 0 and budget > 1 else []
    order = 1
    while heap and len(tokens) < budget:
        neg, _, d, r, parent, base = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(top_ids[d - 1][r])
        parents.append(parent)
        depths.append(d)
        scores.append(-neg)
        if d < D:  # its first child
            heapq.heappush(heap, (neg - top_lp[d][0], order, d + 1, 0, node, -neg))
            order += 1
        if r + 1 < k:  # its next sibling
            heapq.heappush(heap, (-(base + top_lp[d - 1][r + 1]), order, d, r + 1, parent, base))
            order += 1
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.tensor(scores))


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] (parents[i] < i, -1 for the root) -> [N, N] bool: True where node i may attend node j (j is i
    or one of its ancestors)."""
    N = parents.numel()
    mask = torch.eye(N, dtype=torch.bool, device=parents.device)
    for i in range(1, N):  # a node sees what its parent sees, and itself
        mask[i] |= mask[int(parents[i])]
    return mask


def accept_tree_greedy(tree: Tree, target_next: torch.Tensor) -> tuple[list[int], int]:
    """target_next [N]: the target's greedy token after each node (its argmax there) -> (the accepted path's
    nodes, the root first; the target's next token after the path's last node)."""
    path, node = [0], 0
    while True:
        want = int(target_next[node])
        child = next((c for c in tree.children(node) if int(tree.tokens[c]) == want), None)
        if child is None:
            return path, want
        path.append(child)
        node = child


def accept_tree_sampled(tree: Tree, p: torch.Tensor, u: torch.Tensor) -> tuple[list[int], int]:
    """p [N, V]: the target's distribution after each node (after the request's temperature and filters);
    u [D + 1]: uniforms in (0, 1), one per depth the walk may reach -> (the accepted path's nodes, the next
    token). At the node of depth d the token is drawn from p by inverse CDF with u[d] (accept.sample_inverse_cdf:
    never a token of probability 0)."""
    from sglang_dflash.accept import sample_inverse_cdf

    path, node = [0], 0
    while True:
        x = int(sample_inverse_cdf(p[node], u[int(tree.depths[node])]))
        child = next((c for c in tree.children(node) if int(tree.tokens[c]) == x), None)
        if child is None:
            return path, x
        path.append(child)
        node = child


def build_trees(logprobs: torch.Tensor, k: int, budget: int, root_tokens: torch.Tensor):
    """logprobs [bs, D, V], root_tokens [bs] -> tokens, parents, depths, each [bs, N] int64 (N = budget): one
    tree per request. Every request gets exactly `budget` nodes (an error if k and D hold fewer paths)."""
    bs, D = logprobs.shape[:2]
    most = sum(min(k, logprobs.shape[-1]) ** d for d in range(D + 1))
    if budget > most:
        raise ValueError(f"a tree of {budget} nodes needs more paths than top-{k} over {D} rows hold ({most})")
    trees = [build_tree(logprobs[i], k, budget, int(root_tokens[i])) for i in range(bs)]
    return tuple(torch.stack([getattr(t, f) for t in trees]).to(logprobs.device) for f in ("tokens", "parents", "depths"))


def tree_verify_mask(parents: torch.Tensor, prefix_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """parents [bs, N], prefix_lens [bs] -> [bs, 1, N, L] bool (L = max_len >= prefix + N): node i of a request
    sees key column j < prefix (the committed context) and block column prefix + m when node m is i or one of
    its ancestors (ops/attention.paged_block_mask with the ancestor masks; with k = 1, its causal mask)."""
    from sglang_dflash.ops.attention import paged_block_mask

    anc = torch.stack([ancestor_mask(row) for row in parents])  # [bs, N, N]
    return paged_block_mask(prefix_lens, parents.shape[1], max_len, causal=True, block_mask=anc)


def flat_verify_mask(parents: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """parents [bs, N], prefix_lens [bs] -> the verify forward's custom_mask as SGLang's attention backends read
    it (DFlashVerifyInput / EagleVerifyInput): flat bool, the requests in batch order, each a row-major
    [N queries, prefix + N keys] with the prefix's columns first: tree_verify_mask's entries of each request's
    own key columns."""
    N = parents.shape[1]
    L = int(prefix_lens.max()) + N
    dense = tree_verify_mask(parents, prefix_lens, L)[:, 0]  # [bs, N, L]
    own = torch.arange(L, device=parents.device)[None, :] < (prefix_lens.long() + N)[:, None]  # [bs, L]
    return dense[own[:, None, :].expand(-1, N, -1)]


def accept_trees_greedy(tokens: torch.Tensor, parents: torch.Tensor, target_next: torch.Tensor,
                        anc: torch.Tensor | None = None):
    """tokens, parents, target_next [bs, N] (target_next: the target's greedy token after each node) -> (paths
    [bs, D + 1]: the accepted path's nodes, root first, padded with its last node; accept_len [bs]: the drafts
    accepted, the path's length - 1; next_token [bs]: the target's token after the path). accept_tree_greedy for
    every request at once: a node is accepted when it and each of its ancestors below the root hold the target's
    token after their parent. Siblings hold distinct tokens (distinct ranks of one row), so the accepted nodes
    form one path, and its deepest node is the one with the most accepted ancestors. anc [bs, N, N]: the
    ancestor masks, when the caller has them already."""
    bs = tokens.shape[0]
    root = parents.clamp(min=0)
    match = tokens == target_next.gather(1, root)  # [bs, N]: the node holds the target's choice after its parent
    match[:, 0] = True
    if anc is None:  # [bs, N, N]: node i sees ancestor-or-self j
        anc = torch.stack([ancestor_mask(row) for row in parents])
    accepted = ~(anc & ~match[:, None, :]).any(-1)  # [bs, N]: every ancestor-or-self matches
    depth = anc.sum(-1) - 1  # [bs, N]
    accept_len, last = torch.where(accepted, depth, -1).max(dim=1)  # the deepest accepted node
    on_path = anc[torch.arange(bs), last]  # [bs, N]: the last node's ancestors-or-self
    D = int(depth.max())
    order = torch.where(on_path, depth, D + 1).argsort(dim=1)[:, : D + 1]  # nodes by depth, path first
    pos = torch.arange(D + 1, device=tokens.device)[None, :]
    paths = torch.where(pos <= accept_len[:, None], order, last[:, None])
    return paths, accept_len, target_next.gather(1, last[:, None])[:, 0]


def accept_trees_sampled(tokens: torch.Tensor, parents: torch.Tensor, p_node, u: torch.Tensor):
    """accept_tree_sampled for the batch, a depth at a time: tokens, parents [bs, N]; p_node(rows, nodes) -> [len(rows),
    V]: the target's distribution after node nodes[i] of request rows[i] (formed only for the nodes the walks
    reach, as the chain forms its rows lazily); u [bs, D + 1]: request r's uniform at depth d -> (paths
    [bs, D + 1], accept_len [bs], next_token [bs]) as accept_trees_greedy returns them. With the same u each
    request walks exactly as accept_tree_sampled would (whose exactness tests/test_tree.py enumerates)."""
    from sglang_dflash.accept import sample_inverse_cdf

    bs = tokens.shape[0]
    D = u.shape[1] - 1
    node = torch.zeros(bs, dtype=torch.long, device=tokens.device)  # each walk's current node
    paths = torch.zeros(bs, D + 1, dtype=torch.long, device=tokens.device)
    accept_len = torch.zeros(bs, dtype=torch.long, device=tokens.device)
    next_token = torch.zeros(bs, dtype=torch.long, device=tokens.device)
    active = torch.arange(bs, device=tokens.device)
    for d in range(D + 1):
        if active.numel() == 0:
            break
        x = sample_inverse_cdf(p_node(active, node[active]), u[active, d]).long()  # [active]
        hit = (parents[active] == node[active, None]) & (tokens[active] == x[:, None])  # [active, N]: the child
        found = hit.any(1)
        if d == D and bool(found.any()):
            raise ValueError(f"uniforms for depths 0 … {D} only, and the tree goes deeper")
        moved, stopped = active[found], active[~found]
        next_token[stopped] = x[~found]
        node[moved] = hit[found].float().argmax(1)
        if moved.numel():
            paths[moved, d + 1] = node[moved]
        accept_len[moved] += 1
        active = moved
    paths = torch.where(torch.arange(D + 1, device=tokens.device)[None, :] <= accept_len[:, None], paths,
                        paths.gather(1, accept_len[:, None]))
    return paths, accept_len, next_token


def path_order(paths: torch.Tensor, accept_len: torch.Tensor, n: int) -> torch.Tensor:
    """paths [bs, D + 1] (accept_trees_greedy's), accept_len [bs] -> [bs, n]: a permutation of each request's
    nodes, its path's nodes first in path order, then the other nodes in their own order. Position prefix + j
    of the request's req_to_token row takes the slot node order[j] was verified in (page size 1: no K/V moves;
    the other slots stay in the row for the next step)."""
    bs = paths.shape[0]
    place = torch.arange(paths.shape[1], device=paths.device)[None, :].expand(bs, -1)  # [bs, D + 1]
    valid = place <= accept_len[:, None]  # the padding (the last node again) is sent to the root, place 0
    key = (n + torch.arange(n, device=paths.device)).repeat(bs, 1)  # the other nodes after the path, in order
    key.scatter_(1, torch.where(valid, paths, 0), torch.where(valid, place, 0))  # path nodes by their place
    return key.argsort(dim=1)
