"""tree.py (DDTree) against definitions written out by hand: the best-first tree is the set of best paths,
the mask is ancestry, the greedy walk is the brute-force one, and the sampled walk commits tokens distributed
exactly as the target's (by enumeration)."""

import itertools
import math

import pytest
import torch

from sglang_dflash.tree import accept_tree_greedy, accept_tree_sampled, ancestor_mask, build_tree

pytestmark = pytest.mark.unit


def paths_of(tree):
    """Each node's path of tokens from the root (root excluded)."""
    out = []
    for i in range(tree.size):
        path, node = [], i
        while node > 0:
            path.append(int(tree.tokens[node]))
            node = int(tree.parents[node])
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed, D, k, budget", [(0, 3, 2, 8), (1, 4, 3, 20), (2, 2, 4, 30), (3, 5, 1, 4), (4, 3, 3, 40)])
def test_the_tree_is_the_budget_best_paths(seed, D, k, budget):
    logprobs = torch.log_softmax(torch.randn(D, 12, generator=torch.Generator().manual_seed(seed)) * 2, dim=-1)
    tree = build_tree(logprobs, k, budget, root_token=99)
    top = logprobs.topk(k, dim=-1)
    every = {}  # every path of top-k tokens, of every depth 1 … D, with its score
    for d in range(1, D + 1):
        for ranks in itertools.product(range(k), repeat=d):
            path = tuple(int(top.indices[i, r]) for i, r in enumerate(ranks))
            every[path] = sum(float(top.values[i, r]) for i, r in enumerate(ranks))
    best = sorted(every, key=every.get, reverse=True)[:budget - 1]
    paths = paths_of(tree)
    assert tree.size == min(budget, len(every) + 1) and int(tree.tokens[0]) == 99 and paths[0] == ()
    assert set(paths[1:]) == set(best) and len(set(paths)) == tree.size  # the best paths, each once
    assert all(int(tree.parents[i]) < i for i in range(1, tree.size))  # a parent before its children
    assert tree.depths.tolist() == [len(p) for p in paths]
    for i in range(1, tree.size):
        assert math.isclose(float(tree.scores[i]), every[paths[i]], rel_tol=1e-5, abs_tol=1e-5)


def test_top_1_is_the_chain():
    logprobs = torch.log_softmax(torch.randn(6, 10, generator=torch.Generator().manual_seed(5)), dim=-1)
    tree = build_tree(logprobs, 1, 5, root_token=3)
    assert tree.tokens.tolist() == [3] + logprobs.argmax(-1)[:4].tolist()
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3] and tree.depths.tolist() == [0, 1, 2, 3, 4]


def test_ancestor_mask():
    tree = build_tree(torch.log_softmax(torch.randn(3, 8, generator=torch.Generator().manual_seed(2)), -1), 3, 12)
    mask = ancestor_mask(tree.parents)
    for i in range(tree.size):
        ancestors, node = {i}, i
        while node > 0:
            node = int(tree.parents[node])
            ancestors.add(node)
        assert mask[i].nonzero().flatten().tolist() == sorted(ancestors)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_walk(seed):
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.log_softmax(torch.randn(4, 6, generator=g), -1), 2, 14, root_token=0)
    target_next = torch.randint(0, 6, (tree.size,), generator=g)
    for node in range(tree.size):  # plant the target's choice on some child, so walks go deep
        kids = tree.children(node)
        if kids and torch.rand(1, generator=g) < 0.7:
            target_next[node] = tree.tokens[kids[int(torch.randint(len(kids), (1,), generator=g))]]
    path, nxt = accept_tree_greedy(tree, target_next)
    want, node = [0], 0  # brute force: follow the target's choice while a child holds it
    while any(int(tree.tokens[c]) == int(target_next[node]) for c in tree.children(node)):
        node = [c for c in tree.children(node) if int(tree.tokens[c]) == int(target_next[node])][0]
        want.append(node)
    assert path == want and nxt == int(target_next[node])


@pytest.mark.parametrize("seed, k, budget", [(0, 2, 7), (1, 3, 10), (2, 1, 4)])
def test_sampled_walk_is_the_targets_distribution_by_enumeration(seed, k, budget):
    """Enumerate every draw the target can make (its probability: the product of p along the way), drive the
    rule with a uniform inside that draw's CDF interval, and check: the rule commits exactly the target's own
    draws up to the first that leaves the tree (so each committed sequence has the target's probability), and
    the probabilities of everything it can commit sum to 1."""
    V, D = 4, 3
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.log_softmax(torch.randn(D, V, generator=g) * 2, -1), k, budget, root_token=0)
    p = torch.softmax(torch.randn(tree.size, V, generator=g) * 1.5, -1)
    p[0, 3] = 0.0  # a token the target cannot draw: never committed
    p = p / p.sum(-1, keepdim=True)
    committed = {}

    def walk(node, drawn, prob, u):
        cdf = torch.cumsum(p[node].double(), 0)
        for x in range(V):
            mass = float(p[node, x])
            if mass == 0:
                continue
            lo = float(cdf[x - 1]) if x else 0.0
            u_here = u + [(lo + float(cdf[x])) / 2]  # a uniform that draws x at this node
            child = [c for c in tree.children(node) if int(tree.tokens[c]) == x]
            if child:
                walk(child[0], drawn + [x], prob * mass, u_here)
            else:  # x leaves the tree: the walk commits drawn + [x]
                padded = torch.tensor(u_here + [0.5] * (D + 1 - len(u_here)), dtype=torch.float64)
                path, nxt = accept_tree_sampled(tree, p, padded)
                assert [int(tree.tokens[n]) for n in path[1:]] + [nxt] == drawn + [x]
                committed[tuple(drawn + [x])] = committed.get(tuple(drawn + [x]), 0.0) + prob * mass

    walk(0, [], 1.0, [])
    assert math.isclose(sum(committed.values()), 1.0, rel_tol=1e-6)
    assert all(seq[0] != 3 for seq in committed)
    for seq, prob in committed.items():  # the target's own probability of the sequence, node by node
        node, want = 0, 1.0
        for x in seq:
            want *= float(p[node, x])
            nxt = [c for c in tree.children(node) if int(tree.tokens[c]) == x]
            node = nxt[0] if nxt else node
        assert math.isclose(prob, want, rel_tol=1e-9)


def test_batched_trees_and_their_verify_mask():
    from sglang_dflash.tree import build_trees, tree_verify_mask

    g = torch.Generator().manual_seed(7)
    logprobs = torch.log_softmax(torch.randn(3, 4, 9, generator=g), -1)
    tokens, parents, depths = build_trees(logprobs, 2, 9, torch.tensor([5, 6, 7]))
    assert tokens.shape == parents.shape == depths.shape == (3, 9) and tokens[:, 0].tolist() == [5, 6, 7]
    for i in range(3):
        one = build_tree(logprobs[i], 2, 9, 5 + i)
        assert tokens[i].tolist() == one.tokens.tolist() and parents[i].tolist() == one.parents.tolist()
    with pytest.raises(ValueError, match="needs more paths"):
        build_trees(logprobs, 1, 6, torch.tensor([5, 6, 7]))  # a chain of 4 rows holds 5 nodes

    prefix = torch.tensor([3, 0, 6])
    L = 6 + 9 + 2
    mask = tree_verify_mask(parents, prefix, L)
    assert mask.shape == (3, 1, 9, L)
    for r in range(3):
        anc = ancestor_mask(parents[r])
        for i in range(9):
            for j in range(L):
                m = j - int(prefix[r])
                want = j < int(prefix[r]) or (0 <= m < 9 and bool(anc[i, m]))
                assert bool(mask[r, 0, i, j]) == want, (r, i, j)


def test_a_chain_tree_masks_as_the_causal_block():
    """k = 1: the tree is the chain, and its mask is the chain verify's causal block mask."""
    from sglang_dflash.ops.attention import paged_block_mask
    from sglang_dflash.tree import build_trees, tree_verify_mask

    logprobs = torch.log_softmax(torch.randn(2, 7, 11, generator=torch.Generator().manual_seed(3)), -1)
    _, parents, _ = build_trees(logprobs, 1, 5, torch.tensor([1, 2]))
    prefix = torch.tensor([4, 9])
    assert torch.equal(tree_verify_mask(parents, prefix, 16), paged_block_mask(prefix, 5, 16, causal=True))


def random_tree_batch(seed: int, bs: int = 4, D: int = 4, V: int = 9, k: int = 2, N: int = 10):
    g = torch.Generator().manual_seed(seed)
    from sglang_dflash.tree import build_trees

    return build_trees(torch.log_softmax(torch.randn(bs, D, V, generator=g), -1), k, N,
                       torch.randint(0, V, (bs,), generator=g)), g


@pytest.mark.parametrize("seed", range(8))
def test_the_flat_verify_mask_is_sglangs_layout(seed):
    """flat_verify_mask: per request a row-major [N, prefix + N] block, prefix columns first, as SGLang's
    verify custom_mask (its size check: sum of prefixes × N + N² × bs)."""
    from sglang_dflash.tree import flat_verify_mask

    (_, parents, _), g = random_tree_batch(seed)
    bs, N = parents.shape
    prefix = torch.randint(0, 12, (bs,), generator=g)
    flat = flat_verify_mask(parents, prefix)
    want = torch.cat([torch.cat([torch.ones(N, int(p), dtype=torch.bool), ancestor_mask(row)], 1).flatten()
                      for row, p in zip(parents, prefix)])
    assert flat.dtype == torch.bool and flat.numel() == int(prefix.sum()) * N + N * N * bs and torch.equal(flat, want)


@pytest.mark.parametrize("seed", range(12))
def test_greedy_acceptance_of_a_batch_of_trees_is_each_trees_walk(seed):
    """accept_trees_greedy at once == accept_tree_greedy request by request, with target choices that follow
    the tree for a few levels (a first-choice child, a second-choice one) and then leave it."""
    from sglang_dflash.tree import Tree, accept_trees_greedy

    (tokens, parents, depths), g = random_tree_batch(seed, bs=5, N=12)
    bs, N = tokens.shape
    target_next = torch.randint(0, 9, (bs, N), generator=g)
    for r in range(bs):  # walk down a random child chain and make the target choose it
        node = 0
        for _ in range(int(torch.randint(0, 5, (1,), generator=g))):
            kids = (parents[r] == node).nonzero().flatten()
            if kids.numel() == 0:
                break
            node = int(kids[torch.randint(0, kids.numel(), (1,), generator=g)])
            target_next[r, int(parents[r, node])] = tokens[r, node]
    paths, accept_len, next_token = accept_trees_greedy(tokens, parents, target_next)
    for r in range(bs):
        tree = Tree(tokens[r], parents[r], depths[r], torch.zeros(N))
        path, nxt = accept_tree_greedy(tree, target_next[r])
        assert accept_len[r] == len(path) - 1 and next_token[r] == nxt, r
        assert paths[r].tolist() == path + [path[-1]] * (paths.shape[1] - len(path)), r


def test_the_accepted_path_takes_the_first_positions_and_every_slot_stays_in_the_row():
    """path_order: the accepted nodes' slots go to positions prefix, prefix + 1, … in path order (their K/V
    stays where the verify wrote it), and the other nodes' slots follow, none dropped: the row still owns each
    slot once, for the next step's block and the request's release (which frees them, once)."""
    from sglang_dflash.tree import path_order

    slots = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34]])
    paths = torch.tensor([[0, 2, 4], [0, 0, 0], [0, 1, 3]])
    order = path_order(paths, torch.tensor([2, 0, 2]), 5)
    assert order.tolist() == [[0, 2, 4, 1, 3], [0, 1, 2, 3, 4], [0, 1, 3, 2, 4]]
    window = slots.gather(1, order)  # what req_to_token[prefix : prefix + N] holds after the step
    assert window[:, :3].tolist() == [[10, 12, 14], [20, 21, 22], [30, 31, 33]]
    assert all(sorted(w) == sorted(s) for w, s in zip(window.tolist(), slots.tolist()))


@pytest.mark.parametrize("seed", range(12))
def test_sampled_acceptance_of_a_batch_of_trees_is_each_trees_walk(seed):
    """accept_trees_sampled with the same uniforms == accept_tree_sampled request by request (whose exactness
    the enumeration above proves), the distributions formed only for the nodes the walks reach. The target's
    distributions lean towards the tree's tokens, so that walks go deep and leave at every depth."""
    from sglang_dflash.tree import Tree, accept_trees_sampled

    (tokens, parents, depths), g = random_tree_batch(seed, bs=6, N=12)
    bs, N = tokens.shape
    V, D = 9, int(depths.max())
    logits = torch.randn(bs, N, V, generator=g)
    for r in range(bs):  # each node's distribution favours its children's tokens
        for m in range(1, N):
            logits[r, int(parents[r, m]), int(tokens[r, m])] += 2.0
    p = torch.softmax(logits, -1)
    u = torch.rand(bs, D + 1, generator=g, dtype=torch.float64)
    asked = []

    def p_node(rows, nodes):
        asked.append(len(rows))
        return p[rows, nodes]

    paths, accept_len, next_token = accept_trees_sampled(tokens, parents, p_node, u)
    for r in range(bs):
        path, nxt = accept_tree_sampled(Tree(tokens[r], parents[r], depths[r], torch.zeros(N)), p[r], u[r])
        assert accept_len[r] == len(path) - 1 and next_token[r] == nxt, r
        assert paths[r].tolist() == path + [path[-1]] * (D + 1 - len(path)), r
    assert asked[0] == bs and sum(asked) == int(accept_len.sum()) + bs  # one distribution per node reached
    with pytest.raises(ValueError, match="the tree goes deeper"):
        accept_trees_sampled(tokens, parents, lambda rows, nodes: torch.nn.functional.one_hot(
            tokens[rows].gather(1, (parents[rows] == nodes[:, None]).float().argmax(1, keepdim=True))[:, 0], V).double(),
            u[:, :1])
