// Plotly's FigureWidget whose views stay as wide as their element (FullWidthFigureWidget in
// timeline_widget.py; PLOTLY_WIDGET, plotly's own widget module as text, is declared above).
//
// Plotly draws a view before JupyterLab attaches it to the page, measures no width there and
// falls back to 700 px. Plotly 5's widget resized on JupyterLab's lumino "resize" and
// "after-show" messages; since plotly 6 the widget is an anywidget, whose views get none, so
// the figure keeps its 700 px. And a height set from Python (a redraw with more lanes) pins
// whatever width the figure has then: plotly's own resize leaves such a figure alone.
//
// So each view here compares the width it drew with its element's width, which the cell (or
// the run view's box) stretches to its own, whenever the element's width changes and after
// every redraw; where they differ it unpins the width, unless Python asked for one, and
// resizes plotly's way, with the view's own `autosizeFigure`.
const plotly = await import(URL.createObjectURL(new Blob([PLOTLY_WIDGET], { type: "text/javascript" })));
const view = plotly.FigureView && plotly.FigureView.prototype;

if (view && view.perform_render && view.autosizeFigure && view.remove) {
  const performRender = view.perform_render;
  const remove = view.remove;
  view.perform_render = function () {
    performRender.call(this);
    const fit = () => {
      const width = this.el.clientWidth; // 0 while hidden (in a closed tab) or not yet on the page
      const drawn = this.el._fullLayout && this.el._fullLayout.width;
      const asked = this.model.get("_widget_layout") || {};
      if (!width || !drawn || Math.abs(width - drawn) <= 1 || asked.width != null) return;
      delete this.el.layout.width;
      this.autosizeFigure(); // plotly waits 100 ms for more changes, then redraws once
    };
    this.widthObserver = new ResizeObserver(fit);
    this.widthObserver.observe(this.el);
    this.el.on("plotly_afterplot", fit);
  };
  view.remove = function () {
    if (this.widthObserver) this.widthObserver.disconnect();
    remove.call(this);
  };
} else {
  console.warn("ddl_magic: plotly's widget has no FigureView.perform_render/autosizeFigure here;"
               + " its figures keep the width plotly first gives them");
}

export default plotly.default;
