"""The "Get models" tab: search Hugging Face, see what fits, download with progress.

Thin: it shows repositories, a repository's models with their fit badges, and the
download queue; every click becomes a signal the window hands to the bridge.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from backend.models.gguf_info import format_file_size
from backend.models.download import DownloadProgress, DownloadState
from backend.models.fit import DEFAULT_FIT_CONTEXT, FITS_GPU, FITS_RAM, FitEstimate
from backend.models.hub import CuratedModel, ModelChoice, RepoListing, RepoSummary
from studio.widgets import heading, plain_tooltip, secondary_label

__all__ = ["DiscoverView", "DownloadRow"]

REPO_ROLE = Qt.ItemDataRole.UserRole + 1
CHOICE_ROLE = Qt.ItemDataRole.UserRole + 2
BADGE_COLORS = {FITS_GPU: "#2e7d32", FITS_RAM: "#1565c0"}
TOO_BIG_COLOR = "#c62828"


class DiscoverView(QWidget):
    search_requested = Signal(str, str)  # text, sort ("downloads" or "recent")
    repo_selected = Signal(str, int)  # repo id, context for the estimate
    context_changed = Signal(object, int)  # the RepoListing shown, the new context
    download_requested = Signal(object, str)  # ModelChoice, commit
    pause_requested = Signal(str)  # job id
    resume_requested = Signal(str)
    cancel_requested = Signal(str)
    token_entered = Signal(str)

    def __init__(self, curated: list[CuratedModel], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._curated = curated
        self._listing: RepoListing | None = None
        self.rows: dict[str, DownloadRow] = {}

        self.query = QLineEdit()
        self.query.setPlaceholderText("Search Hugging Face for GGUF models")
        self.query.setAccessibleName("Search Hugging Face")
        self.query.setClearButtonEnabled(True)
        self.query.returnPressed.connect(self._search)
        self.sort = QComboBox()
        self.sort.addItem("Most downloaded", "downloads")
        self.sort.addItem("Recently updated", "recent")
        self.sort.setAccessibleName("Sort results")
        self.search_button = QPushButton("Search")
        self.search_button.clicked.connect(self._search)
        self.token_button = QPushButton("Token…")
        self.token_button.setToolTip("A Hugging Face token for gated models (kept private; HF_TOKEN wins)")
        self.token_button.clicked.connect(self._ask_token)

        self.repos = QListWidget()
        self.repos.setAccessibleName("Repositories")
        self.repos.currentItemChanged.connect(self._on_repo)
        self.repos_title = _plain(QLabel())

        self.context = QSpinBox()
        self.context.setRange(512, 1_048_576)
        self.context.setSingleStep(4096)
        self.context.setValue(DEFAULT_FIT_CONTEXT)
        self.context.setAccessibleName("Context for the memory estimate")
        self.context.editingFinished.connect(self._on_context)
        self.files = QTreeWidget()
        self.files.setAccessibleName("Models in this repository")
        self.files.setHeaderLabels(["Model", "Size", "Will it fit"])
        self.files.setRootIsDecorated(True)
        self.files.currentItemChanged.connect(lambda *_: self._update_download_button())
        self.files.itemDoubleClicked.connect(lambda *_: self._download())
        self.download_button = QPushButton("&Download")
        self.download_button.clicked.connect(self._download)
        # Repository ids, file names and error sentences come from the hub: shown as
        # they are, never interpreted as rich text (markup, links, images).
        self.repo_title = _plain(heading("", 1.1))
        self.status = _plain(secondary_label(""))

        self.queue_box = QVBoxLayout()
        self.queue_box.setContentsMargins(0, 0, 0, 0)
        self.queue_empty = secondary_label("No downloads.")
        self.queue_box.addWidget(self.queue_empty)

        top = QHBoxLayout()
        top.addWidget(self.query, 1)
        top.addWidget(self.sort)
        top.addWidget(self.search_button)
        top.addWidget(self.token_button)
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        left_layout.addWidget(self.repos_title)
        left_layout.addWidget(self.repos, 1)
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(0, 0, 0, 0)
        right_layout.addWidget(self.repo_title)
        context_row = QHBoxLayout()
        context_row.addWidget(QLabel("Context for the estimate:"))
        context_row.addWidget(self.context)
        context_row.addStretch(1)
        context_row.addWidget(self.download_button)
        right_layout.addLayout(context_row)
        right_layout.addWidget(self.files, 1)
        self.split = QSplitter()
        self.split.setObjectName("discover_split")  # the window remembers its place
        self.split.addWidget(left)
        self.split.addWidget(right)
        self.split.setSizes([300, 500])
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.status)
        layout.addWidget(self.split, 1)
        layout.addWidget(QLabel("Downloads"))
        layout.addLayout(self.queue_box)
        self.show_curated()
        self._update_download_button()

    # --- what the backend says ---------------------------------------------------------------

    def show_curated(self) -> None:
        self.repos_title.setText("Suggested for coding agents")
        self.repos.clear()
        for model in self._curated:
            item = QListWidgetItem(f"{model.name}  ·  {model.size}")
            item.setToolTip(f"{model.repo_id}\n{model.note}")
            item.setData(REPO_ROLE, model.repo_id)
            self.repos.addItem(item)

    def show_repos(self, repos: list[RepoSummary]) -> None:
        self.set_busy(False)
        self.repos_title.setText(f"{len(repos)} repositories" if repos else "No GGUF repositories match")
        self.repos.clear()
        for repo in repos:
            gated = "  ·  gated" if repo.gated else ""
            item = QListWidgetItem(f"{repo.repo_id}\n{repo.downloads:,} downloads  ·  "
                                   f"{repo.last_modified[:10]}{gated}")
            item.setData(REPO_ROLE, repo.repo_id)
            self.repos.addItem(item)

    def show_listing(self, result: tuple[RepoListing, dict[str, FitEstimate]]) -> None:
        listing, fits = result
        self.set_busy(False)
        self._listing = listing
        self.repo_title.setText(listing.repo_id + ("  (gated: needs a token)" if listing.gated else ""))
        self.files.clear()
        for quant, choices in listing.by_quant().items():
            group = QTreeWidgetItem([quant, "", ""])
            group.setFirstColumnSpanned(True)
            self.files.addTopLevelItem(group)
            for choice in choices:
                parts = f"  ({len(choice.files)} parts)" if len(choice.files) > 1 else ""
                item = QTreeWidgetItem([choice.name + parts, format_file_size(choice.size), ""])
                item.setData(0, CHOICE_ROLE, choice)
                fit = fits.get(choice.name)
                if fit is not None:
                    item.setText(2, fit.verdict)
                    item.setToolTip(2, fit.details())
                    item.setForeground(2, _color(fit.verdict))
                group.addChild(item)
            group.setExpanded(True)
        self.files.resizeColumnToContents(0)
        if not listing.choices:
            self.status.setText(f"{listing.repo_id} has no GGUF model files.")
        self._update_download_button()

    def show_progress(self, progress: DownloadProgress) -> None:
        row = self.rows.get(progress.job_id)
        if row is None:
            row = DownloadRow(progress.job_id, self)
            self.rows[progress.job_id] = row
            self.queue_box.addWidget(row)
            self.queue_empty.hide()
        row.show_progress(progress)

    def show_error(self, message: str) -> None:
        self.set_busy(False)
        self.status.setText(message)

    def set_busy(self, busy: bool, text: str = "") -> None:
        self.search_button.setEnabled(not busy)
        self.status.setText(text)

    # --- what the user does --------------------------------------------------------------------

    def selected_choice(self) -> ModelChoice | None:
        item = self.files.currentItem()
        return item.data(0, CHOICE_ROLE) if item is not None else None

    def _search(self) -> None:
        text = self.query.text().strip()
        if not text:
            self.show_curated()
            return
        self.set_busy(True, "Searching Hugging Face…")
        self.search_requested.emit(text, self.sort.currentData())

    def _on_repo(self, item: QListWidgetItem | None, _previous: object = None) -> None:
        if item is None:
            return
        repo_id = item.data(REPO_ROLE)
        self.set_busy(True, f"Reading {repo_id}…")
        self.repo_selected.emit(repo_id, self.context.value())

    def _on_context(self) -> None:
        if self._listing is not None:
            self.context_changed.emit(self._listing, self.context.value())

    def _download(self) -> None:
        choice = self.selected_choice()
        if choice is not None and self._listing is not None:
            self.download_requested.emit(choice, self._listing.commit)

    def _update_download_button(self) -> None:
        self.download_button.setEnabled(self.selected_choice() is not None)

    def _ask_token(self) -> None:
        token, ok = QInputDialog.getText(self, "Hugging Face token",
                                         "Token for gated models (starts with hf_):",
                                         QLineEdit.EchoMode.Password)
        if ok and token.strip():
            self.token_entered.emit(token.strip())


class DownloadRow(QWidget):
    """One download: name, bar, bytes / speed / time left, pause or resume, cancel."""

    def __init__(self, job_id: str, view: DiscoverView) -> None:
        super().__init__(view)
        self.job_id = job_id
        self.state: DownloadState | None = None
        self.name = _plain(QLabel())
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setAccessibleName("Download progress")
        self.detail = _plain(secondary_label())
        self.pause_button = QPushButton("Pause")
        self.pause_button.clicked.connect(
            lambda: (view.resume_requested if self._resumes() else view.pause_requested).emit(self.job_id))
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(lambda: view.cancel_requested.emit(self.job_id))
        layout = QGridLayout(self)
        layout.setContentsMargins(0, 2, 0, 2)
        layout.addWidget(self.name, 0, 0)
        layout.addWidget(self.bar, 0, 1)
        layout.addWidget(self.pause_button, 0, 2)
        layout.addWidget(self.cancel_button, 0, 3)
        layout.addWidget(self.detail, 1, 0, 1, 4)
        layout.setColumnStretch(1, 1)

    def show_progress(self, p: DownloadProgress) -> None:
        self.state = p.state
        self.name.setText(p.name)
        self.name.setToolTip(plain_tooltip(p.repo_id))
        self.bar.setValue(int(p.fraction * 1000))
        self.detail.setText("Ready in the library." if p.state is DownloadState.DONE else p.describe())
        self.pause_button.setText("Resume" if self._resumes() else "Pause")
        self.pause_button.setEnabled(not p.state.finished and p.state is not DownloadState.VERIFYING)
        self.cancel_button.setEnabled(not p.state.finished)

    def _resumes(self) -> bool:
        """Whether the Pause button reads Resume: a paused or failed download."""
        return self.state in (DownloadState.PAUSED, DownloadState.FAILED)


def _plain(label: QLabel) -> QLabel:
    label.setTextFormat(Qt.TextFormat.PlainText)
    return label


def _color(verdict: str) -> QColor:
    return QColor(BADGE_COLORS.get(verdict, TOO_BIG_COLOR))
