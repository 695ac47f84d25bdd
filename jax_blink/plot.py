"""Pictures of plans: the topology with each tree in its own colour, and link utilisation.

matplotlib (Agg backend, no display needed) + networkx drawing.
"""

from __future__ import annotations

import math
import textwrap

import networkx as nx

from . import collectives

MAX_TREE_PANELS = 11
PANEL_INCHES = 4.2
DPI = 110
_CHAR_EM = 0.6  # average character width of matplotlib's default sans-serif font, in ems


def fit_text(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped at spaces into lines no wider than ``width_in`` inches at ``fontsize`` points
    (72 points per inch, characters ~0.6 em wide), so titles are never clipped at the figure edge."""
    chars = max(10, int(width_in * 72 / (_CHAR_EM * fontsize)))
    return "\n".join(textwrap.wrap(text, chars, break_on_hyphens=False)) or text


def layout(topology) -> dict:
    """Deterministic node positions: GPUs on a circle in id order (radius 1 up to 8 GPUs, growing
    with their number beyond), switch/host nodes placed by a seeded spring layout with the GPUs held
    fixed. Returns {node: (x, y)}."""
    gpus = topology.gpus
    r = max(1.0, len(gpus) / 8)  # keep 8 GPUs' spacing on bigger machines, so GPU nodes never overlap
    pos = {}
    for i, g in enumerate(gpus):
        a = math.pi / 2 - 2 * math.pi * i / max(1, len(gpus))
        pos[g] = (r * math.cos(a), r * math.sin(a))
    others = topology.switches
    if others:
        und = topology.graph.to_undirected(as_view=False)
        init = dict(pos)
        for j, s in enumerate(others):
            a = 2 * math.pi * j / len(others)
            init[s] = (0.45 * r * math.cos(a), 0.45 * r * math.sin(a))
        pos = nx.spring_layout(und, pos=init, fixed=gpus or None, seed=0, k=0.6, iterations=100)
    return {n: (float(x), float(y)) for n, (x, y) in pos.items()}


def _base(ax, topology, pos, nodes_highlight):
    g = topology.graph
    und = nx.Graph()
    und.add_nodes_from(g.nodes)
    und.add_edges_from(g.edges)
    nx.draw_networkx_edges(und, pos, ax=ax, edge_color="#d0d0d0", width=1.0)
    gpus = topology.gpus
    sw = topology.switches
    colors = ["#ffd27f" if n in nodes_highlight else "#f0f0f0" for n in gpus]
    nx.draw_networkx_nodes(und, pos, nodelist=gpus, node_color=colors, edgecolors="#333333",
                           node_size=420, ax=ax)
    if sw:
        nx.draw_networkx_nodes(und, pos, nodelist=sw, node_color="#e8e8ff", edgecolors="#777799",
                               node_shape="s", node_size=160, ax=ax)
    labels = {n: str(n) for n in gpus}
    labels.update({s: _short(s) for s in sw})
    nx.draw_networkx_labels(und, pos, labels=labels, font_size=7, ax=ax)
    ax.set_axis_off()


def _short(name: str) -> str:
    return (str(name).replace("pcie-switch-", "sw").replace("nvswitch", "NVS").replace("network", "net"))


def draw_plan(topology, plan, path, *, link_util: dict | None = None, title: str | None = None,
              max_tree_panels: int = MAX_TREE_PANELS) -> int:
    """Write :func:`plan_figure` to the PNG ``path``; returns its number of panels. Raises OSError
    if the file cannot be written."""
    import matplotlib.pyplot as plt

    fig, panels = plan_figure(topology, plan, link_util=link_util, title=title, max_tree_panels=max_tree_panels)
    try:
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return panels


def plan_figure(topology, plan, *, link_util: dict | None = None, title: str | None = None,
                max_tree_panels: int = MAX_TREE_PANELS):
    """A matplotlib figure: one panel per tree (heaviest first) or, for a ring plan, per ring (the
    rest summarised), and a utilisation panel.

    Args:
      topology: the Topology the plan runs on.
      plan: a ``jax_blink.planner.model.Plan``.
      link_util: {(u, v): utilisation 0..1} (e.g. ``SimResult.link_util``); default: the plan's
        bandwidth-only load / capacity (``Plan.link_loads``).
      max_tree_panels: trees (rings) drawn individually; the rest are summed in the last panel title.

    Each tree's physical hops are drawn as arrows (broadcast direction) in the tree's colour, width
    proportional to the tree's weight. Titles are wrapped to the figure (:func:`fit_text`) and
    constrained layout keeps every title, label and the colour bar inside it. Returns
    ``(figure, number of panels)``; the caller closes the figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import cm
    from matplotlib import colors as mcolors

    pos = layout(topology)
    # panels: (title, hops, GB/s, root or None); a ring plan is drawn ring by ring
    rings = sorted(plan.rings(), key=lambda r: -r[1])  # heaviest first, like the trees
    items = [(f"ring {j}: {b:.2f} GB/s", hops, b, None) for j, (hops, b) in enumerate(rings)]
    if not items:
        for i, t in enumerate(sorted(plan.trees, key=lambda t: -t.weight_gbps)):
            hops = t.edges
            if not collectives.get(plan.collective).broadcasts:  # reduce, reduce-scatter: data flows up
                hops = tuple((b, a) for a, b in (t.edges if t.reduce_edges is None else t.reduce_edges))
            items.append((f"tree {i}: root {t.root}, {t.weight_gbps:.2f} GB/s", hops, t.weight_gbps, t.root))
    unit = "rings" if plan.rings() else "trees"
    shown, hidden = items[:max_tree_panels], items[max_tree_panels:]
    panels = len(shown) + 1
    ncols = min(4, panels)
    nrows = math.ceil(panels / ncols)
    # constrained layout makes room for the (wrapped) titles, the suptitle and the colour bar
    fig, axes = plt.subplots(nrows, ncols, figsize=(PANEL_INCHES * ncols, PANEL_INCHES * nrows), squeeze=False,
                             layout="constrained")
    palette = plt.get_cmap("tab10" if len(shown) <= 10 else "tab20")
    wmax = max((it[2] for it in items), default=1.0) or 1.0
    devs = set(plan.devices)
    for i, (label, hops, w, root) in enumerate(shown):
        ax = axes[i // ncols][i % ncols]
        _base(ax, topology, pos, devs)
        hops = list(dict.fromkeys(hops))  # a repeated hop is drawn once
        dg = nx.DiGraph(hops)
        nx.draw_networkx_edges(dg, pos, ax=ax, edgelist=hops, edge_color=[palette(i % palette.N)],
                               width=1.5 + 4.5 * w / wmax, arrows=True, arrowsize=14,
                               connectionstyle="arc3,rad=0.08", node_size=420)
        if root is not None:
            nx.draw_networkx_nodes(dg, pos, nodelist=[root], node_color="#ff7f50", edgecolors="#000000",
                                   node_size=460, ax=ax)
            nx.draw_networkx_labels(dg, pos, labels={root: str(root)}, font_size=7, ax=ax)
        ax.set_title(fit_text(label, PANEL_INCHES, 9), fontsize=9)
    # utilisation panel
    ax = axes[(panels - 1) // ncols][(panels - 1) % ncols]
    _base(ax, topology, pos, devs)
    if link_util is None:
        link_util = {e: load / topology.graph.edges[e]["bandwidth_gbps"] for e, load in plan.link_loads().items()}
    und_util: dict = {}
    for (u, v), x in link_util.items():
        key = (u, v) if (v, u) not in und_util else (v, u)
        und_util[key] = max(und_util.get(key, 0.0), float(x))
    used = [(e, x) for e, x in und_util.items() if x > 0]
    norm = mcolors.Normalize(vmin=0.0, vmax=1.0)
    cmap = plt.get_cmap("viridis")
    if used:
        ug = nx.Graph([e for e, _ in used])
        nx.draw_networkx_edges(ug, pos, ax=ax, edgelist=[e for e, _ in used],
                               edge_color=[cmap(norm(x)) for _, x in used], width=4.0)
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.046, pad=0.04,
                 label="busiest direction: busy time / total")
    extra = f" (+{len(hidden)} lighter {unit}, {sum(it[2] for it in hidden):.2f} GB/s)" if hidden else ""
    ax.set_title(fit_text("link utilisation" + extra, PANEL_INCHES * 0.8, 9), fontsize=9)  # beside the colour bar
    for j in range(panels, nrows * ncols):
        axes[j // ncols][j % ncols].set_axis_off()
    root = "" if plan.root is None else f" root {plan.root}"
    title = title or (f"{plan.collective}{root} on {topology.name} GPUs {list(plan.devices)}: "
                      f"{plan.shape()}, {plan.rate_gbps:.2f} GB/s")
    fig.suptitle(fit_text(title, PANEL_INCHES * ncols, 11), fontsize=11)
    return fig, panels
